"""`mobile-moe sdk --out DIR`: the folder an app ships. An app outside this tree builds against DIR alone (pkg-config,
and CMake's find_package), the folder moves, and the app runs with no environment variables: its answers are
predict's. The library in it names no path of this project's environment and needs no backend a bundle cannot use."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_build
from test_native_library import images, library, python_predictions  # noqa: F401 (fixtures)

from mobile_moe.errors import UsageError
from mobile_moe.library.sdk import write_sdk

pytestmark = [pytest.mark.export, needs_build]

APP_CMAKE = """cmake_minimum_required(VERSION 3.19)
project(app C)
find_package(mobile_moe 2 REQUIRED CONFIG)
add_executable(app app_example.c)
target_link_libraries(app PRIVATE mobile_moe::mobile_moe)
"""


@pytest.fixture(scope="module")
def sdk(library, tmp_path_factory):  # noqa: F811 (the imported fixture)
    return write_sdk(tmp_path_factory.mktemp("sdk") / "mobile-moe-sdk")


def elf(path, *flags) -> str:
    return subprocess.run(["readelf", *flags, str(path)], capture_output=True, text=True, check=True).stdout


def test_the_sdks_library_is_relocatable_versioned_and_carries_only_what_it_needs(sdk):
    dynamic = elf(sdk / "lib" / "libmobile_moe.so.2", "-d")
    assert "Library soname: [libmobile_moe.so.2]" in dynamic and "Library runpath: [$ORIGIN]" in dynamic
    shipped = sorted(path.name for path in (sdk / "lib").glob("libexecutorch*"))
    assert shipped == ["libexecutorch.so", "libexecutorch_backend_xnnpack.so", "libexecutorch_kernels_optimized.so",
                       "libexecutorch_threadpool.so"]  # fmt: skip
    for path in (sdk / "lib").glob("*.so*"):  # every search path relative to the library, and inside the folder
        runpaths = re.findall(r"Library (?:runpath|rpath): \[([^\]]*)\]", elf(path, "-d"))
        entries = [entry for paths in runpaths for entry in paths.split(":") if entry]
        assert all(entry.startswith("$ORIGIN") for entry in entries), (path.name, entries)
        places = [(sdk / "lib" / entry.removeprefix("$ORIGIN").lstrip("/")).resolve() for entry in entries]
        outside = [place for place in places if place.exists() and not place.is_relative_to(sdk.resolve())]
        assert outside == [], (path.name, outside)


def test_an_app_built_against_the_moved_sdk_folder_alone_answers_as_predict(sdk, bundle, images, tmp_path):  # noqa: F811
    subprocess.run(["make", "-C", str(sdk / "examples")], check=True, capture_output=True, timeout=120)
    moved = tmp_path / "moved" / "sdk"
    moved.parent.mkdir()
    shutil.copytree(sdk, moved, symlinks=True)  # a copy: the module's other tests keep theirs
    cache = tmp_path / "packed-weights"
    result = subprocess.run([str(moved / "examples" / "mobile_moe_app"), str(bundle), str(images), "--iterations",
                             "8", "--cache-experts", "1", "--weight-cache-dir", str(cache)], env={},
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0 and result.stderr == "", result.stderr
    report = json.loads(result.stdout)
    expected = python_predictions(bundle, images)
    assert report["classes"] == [int(np.argmax(p.logits)) for p in expected]
    assert report["experts"] == [int(p.experts[0]) for p in expected]


def test_cmake_finds_the_moved_sdk_and_pkg_config_names_only_it(sdk, tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    shutil.copy2(sdk / "examples" / "app_example.c", app)
    (app / "CMakeLists.txt").write_text(APP_CMAKE)
    moved = tmp_path / "elsewhere"
    shutil.copytree(sdk, moved, symlinks=True)
    for command in (["cmake", "-S", str(app), "-B", str(app / "build"), f"-DCMAKE_PREFIX_PATH={moved}"],
                    ["cmake", "--build", str(app / "build")]):  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, timeout=180)
    env = {**os.environ, "PKG_CONFIG_PATH": str(moved / "lib" / "pkgconfig")}
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "mobile_moe"], capture_output=True, text=True,
                           env=env, check=True).stdout.split()  # fmt: skip
    include, libdir, name = flags
    assert include.startswith("-I") and Path(include[2:]).resolve() == moved / "include"
    assert libdir.startswith("-L") and Path(libdir[2:]).resolve() == moved / "lib" and name == "-lmobile_moe"


def test_an_sdk_is_never_written_over_a_folder_or_a_file_it_did_not_write(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(UsageError, match="not a mobile-moe SDK folder"):
        write_sdk(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    (tmp_path / "a-file").write_text("keep too")
    with pytest.raises(UsageError, match="exists and is not a directory"):
        write_sdk(tmp_path / "a-file")
    assert (tmp_path / "a-file").read_text() == "keep too"


def test_the_android_archive_has_an_aars_layout_and_its_classes_run_on_the_host(library, tmp_path):  # noqa: F811
    """java/package_aar.sh (build_android.sh's last step) on the host's libraries: classes.jar, jni/ABI/ with both
    libraries, AndroidManifest.xml; the jar's classes load the JNI library and answer on the host JVM. (On the host the
    JNI library still finds libmobile_moe.so.2 through its build's rpath; an Android build has no SOVERSION.)"""
    import zipfile

    from mobile_moe.library.build import SOURCE_DIR

    if shutil.which("javac") is None or not (library.parent / "libmobile_moe_jni.so").is_file():
        pytest.skip("no JDK here (javac; on a fresh machine `apt-get install openjdk-17-jdk-headless`)")
    aar = tmp_path / "mobile-moe.aar"
    subprocess.run([str(SOURCE_DIR / "java" / "package_aar.sh"), str(aar), "x86_64", str(library.parent)],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    names = set(zipfile.ZipFile(aar).namelist())
    assert {"AndroidManifest.xml", "classes.jar", "jni/x86_64/libmobile_moe.so",
            "jni/x86_64/libmobile_moe_jni.so"} <= names  # fmt: skip
    zipfile.ZipFile(aar).extractall(tmp_path / "aar")
    (tmp_path / "Version.java").write_text(
        "public class Version { public static void main(String[] a) { "
        "System.out.println(org.mobilemoe.MobileMoe.version()); } }"
    )
    classpath = str(tmp_path / "aar" / "classes.jar")
    subprocess.run(["javac", "-cp", classpath, "-d", str(tmp_path), str(tmp_path / "Version.java")], check=True)
    jni = tmp_path / "aar" / "jni" / "x86_64"
    result = subprocess.run(["java", f"-Djava.library.path={jni}", "-cp", f"{classpath}:{tmp_path}", "Version"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0 and result.stdout.startswith("mobile-moe libmobile_moe 2."), result.stderr


def readme_block(sdk: Path, name: str) -> str:
    """The shell block the SDK's README marks `<!-- sdk-readme: NAME -->`."""
    readme = (sdk / "README.md").read_text()
    return readme.split(f"<!-- sdk-readme: {name} -->\n```sh\n")[1].split("```")[0]


def test_an_app_built_and_shipped_as_the_sdks_readme_says_answers_as_predict(sdk, bundle, images, tmp_path):  # noqa: F811
    """The README's own commands, run as written: build with pkg-config, ship the libraries beside the binary; the
    shipped folder moved and run with no environment answers as predict, and names no path into the SDK."""
    readme = (sdk / "README.md").read_text()
    assert "{" + "version}" not in readme and "libmobile_moe 2." in readme
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy2(sdk / "examples" / "app_example.c", work / "app.c")
    script = readme_block(sdk, "build") + readme_block(sdk, "ship")
    subprocess.run(["bash", "-euc", script], cwd=work, env={"SDK": str(sdk), "PATH": os.environ["PATH"]}, check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    shipped = tmp_path / "installed"
    shutil.move(work / "dist", shipped)
    assert re.findall(r"Library runpath: \[([^\]]*)\]", elf(shipped / "app", "-d")) == ["$ORIGIN"]
    result = subprocess.run([str(shipped / "app"), str(bundle), str(images), "--iterations", "8", "--weight-cache-dir",
                             str(tmp_path / "cache")], env={}, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0 and result.stderr == "", result.stderr
    expected = python_predictions(bundle, images)
    assert json.loads(result.stdout)["classes"] == [int(np.argmax(p.logits)) for p in expected]


def test_the_sdk_carries_the_java_sources_and_the_android_build(sdk):
    if not (sdk / "java").exists():
        pytest.skip("no JDK here: the SDK has no Java binding")
    listing = subprocess.run(["jar", "tf", str(sdk / "java" / "mobile-moe-sources.jar")], capture_output=True,
                             text=True, check=True).stdout.split()  # fmt: skip
    assert "org/mobilemoe/MobileMoe.java" in listing
    assert (sdk / "source" / "build_android.sh").is_file() and (sdk / "source" / "CMakeLists.txt").is_file()
    assert "source/build_android.sh" in (sdk / "README.md").read_text()
