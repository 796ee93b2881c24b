"""Hostile storage and hostile sizes, beyond the library's own process (tests/library_faults.c has those): a phone
whose storage is full under the packed-weight folder, a per-user folder the user never chose that cannot be used, and
an app's topK of Integer.MAX_VALUE, through the runner, bench's reading of a crash, the toolkit's derived folders and
the Java binding. A full file system is a 256 KiB tmpfs mounted for the test (root only: the test skips elsewhere)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import needs_build
from faults import small_file_system
from test_native_library import library  # noqa: F401 (fixture)

from mobile_moe.device_bench import native_runner
from mobile_moe.device_bench.native_runner import parse_runner_output
from mobile_moe.errors import UsageError
from mobile_moe.library.binding import default_weight_cache_dir
from mobile_moe.library.build import JNI_LIBRARY_NAME, SOURCE_DIR, build_runner
from mobile_moe.utils import cache

pytestmark = pytest.mark.export

# XNNPACK takes a packed-weight file's path as a backend option of at most 255 bytes, and the library hands it paths
# this much longer than their folder's (packed_cache.cpp longest_cache_path: a key, ".xnnpack", staged_files.h's longest
# staged suffix, ".scratch").
MAX_CACHE_PATH = 255


def longest_cache_path(folder: Path) -> int:
    host = socket.gethostname().split(".")[0]
    return len(os.fsencode(str(folder) + f"/{'0' * 32}.xnnpack.tmp-{'9' * 10}-{'f' * 8}@{host}.scratch"))


def fill(folder: Path) -> None:
    """Write into `folder` until its file system is full."""
    out = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(out, b"\0" * 4096):
            pass
    except OSError:  # No space left on device: full
        pass
    finally:
        os.close(out)


def runner_by_hand(runner: Path, bundle: Path, env: dict[str, str | None], **run) -> subprocess.CompletedProcess:
    """The runner as a user starts it on a phone: its own defaults, the per-user packed-weight folder."""
    environment = {name: value for name, value in {**os.environ, **env}.items() if value is not None}
    command = [str(runner), "--bundle", str(bundle), "--random", "2", "--iterations", "1"]
    outputs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **run}
    return subprocess.run(command, env=environment, timeout=300, **outputs)


@needs_build
def test_a_full_disk_under_the_default_folder_is_a_run_packed_in_memory(runner, bundle, tmp_path):
    """Where the first open that packed a graph died of SIGBUS: every graph packs in memory, the answers come back,
    and the folder holds nothing staged."""
    with small_file_system(tmp_path / "full") as full:
        result = runner_by_hand(runner, bundle, {"MOBILE_MOE_WEIGHT_CACHE": str(full), "MOBILE_MOE_DEBUG": "1"})
        assert result.returncode == 0, result.stderr.decode()[-2000:]
        said = [line for line in result.stderr.decode().splitlines() if "no room" in line]
        assert said and all(str(full) in line for line in said)
        report = json.loads(result.stdout)
        assert {load["cache"] for load in report["loads"]} == {"off"}
        assert not [path.name for path in full.iterdir() if ".tmp-" in path.name or path.suffix == ".xnnpack"]


@needs_build
def test_a_verified_files_list_that_cannot_be_written_leaves_nothing(runner, bundle, tmp_path):
    """A folder with no byte left: the list of verified files is not kept (the log says so), nothing staged stays, and
    the run answers."""
    with small_file_system(tmp_path / "full", size="64k") as full:
        fill(full)
        result = runner_by_hand(runner, bundle, {"MOBILE_MOE_WEIGHT_CACHE": str(full), "MOBILE_MOE_DEBUG": "1"})
        assert result.returncode == 0, result.stderr.decode()[-2000:]
        assert "cannot remember the verified bundle files" in result.stderr.decode()
        assert [path.name for path in full.iterdir()] == ["filler"]


@needs_build
def test_a_report_that_cannot_be_written_is_an_error_not_a_success(runner, bundle, tmp_path):
    """stdout a file on a full disk: exit 1 with one line, never exit 0 with half a report."""
    with small_file_system(tmp_path / "full", size="64k") as full:
        fill(full)
        with open(full / "report.json", "wb") as out:
            result = runner_by_hand(runner, bundle, {"MOBILE_MOE_WEIGHT_CACHE": None}, stdout=out)
        assert result.returncode == 1, result.stderr.decode()[-2000:]
        assert result.stderr.decode().strip().splitlines() == [
            "mobile_moe_runner: error: cannot write the report (No space left on device)"
        ]


@needs_build
@pytest.mark.parametrize("over", [0, 1], ids=["longest-usable", "one-too-long"])
def test_the_runner_and_the_toolkit_derive_one_packed_weight_folder_or_none(runner, bundle, tmp_path, over,
                                                                            monkeypatch):  # fmt: skip
    """A per-user folder at XNNPACK's 255 characters is used by both; one character longer, both leave the cache off
    (the runner with a line at its log) and the run goes on: never a refusal of what the user did not ask for. The
    toolkit asks the library (mobile_moe.library.binding.default_weight_cache_dir): one rule."""
    folder = tmp_path / ("w" * (MAX_CACHE_PATH - longest_cache_path(tmp_path) - 1 + over))
    assert longest_cache_path(folder) == MAX_CACHE_PATH + over
    monkeypatch.setenv("MOBILE_MOE_WEIGHT_CACHE", str(folder))
    python = default_weight_cache_dir()
    result = runner_by_hand(runner, bundle, {"MOBILE_MOE_DEBUG": "1"})
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    report = json.loads(result.stdout)
    assert report["weight_cache_dir"] == (str(python) if python is not None else "")
    assert (python is None) == bool(over) and ("packed-weight cache off" in result.stderr.decode()) == bool(over)


@pytest.mark.parametrize("env", [{"MOBILE_MOE_WEIGHT_CACHE": "file/packed-weights"},
                                 {"XDG_CACHE_HOME": "x" * 200, "MOBILE_MOE_CACHE": None}])  # fmt: skip
def test_a_derived_folder_that_cannot_be_used_is_none_and_the_library_says_why(env, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.delenv("MOBILE_MOE_WEIGHT_CACHE", raising=False)
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(tmp_path / value))
    from mobile_moe.library.binding import load_library

    said: list[tuple[str, str]] = []
    mobile_moe = load_library()
    mobile_moe.set_log(lambda level, message: said.append((level, message)))
    try:
        assert default_weight_cache_dir() is None
    finally:
        mobile_moe.set_log(None)
    assert [message for _, message in said if "packed-weight cache off" in message], said
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file"]  # nothing made of a path too long


def test_no_home_at_all_is_one_line(monkeypatch):
    """A container's user that the password database does not know, with no HOME: a line, not a KeyError."""
    import pwd

    def unknown(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    for name in ("MOBILE_MOE_CACHE", "MOBILE_MOE_WEIGHT_CACHE", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", unknown)
    with pytest.raises(UsageError, match="no home folder") as refused:
        cache.cache_root()
    assert "MOBILE_MOE_CACHE" in str(refused.value) and "\n" not in str(refused.value)


@needs_build
def test_a_build_cache_path_too_long_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MOBILE_MOE_CACHE", str(tmp_path / ("c" * 300)))
    with pytest.raises(UsageError, match="cannot build the native runner in .*File name too long") as refused:
        build_runner()
    assert "MOBILE_MOE_CACHE" in str(refused.value) and "\n" not in str(refused.value)


def crash_line(bundle: Path, folder: Path | None) -> str:
    stderr = "mobile_moe_runner: crashed (signal 7) while predicting image 0\n"
    with pytest.raises(UsageError) as crashed:
        parse_runner_output(-signal.SIGBUS, b"", stderr.encode(), "native runner", bundle, folder)
    return str(crashed.value)


def test_a_sigbus_on_a_full_disk_names_the_folder_not_the_bundle(bundle, tmp_path, monkeypatch):
    """The crash a library without room checks died of: bench says the packed-weight folder's file system is full,
    and names it; with room there (or no folder) it is still a crash on this bundle."""
    folder = tmp_path / "packed-weights"
    folder.mkdir()
    assert "may be corrupt" in crash_line(bundle, folder) and "may be corrupt" in crash_line(bundle, None)
    monkeypatch.setattr(native_runner, "free_bytes", lambda path: 4096)
    line = crash_line(bundle, folder)
    assert f"packed-weight cache folder {folder} is on a full file system (4096 bytes free)" in line
    assert "corrupt" not in line and "SIGBUS" in line and "\n" not in line


def test_a_sigbus_on_a_real_full_file_system(bundle, tmp_path):
    with small_file_system(tmp_path / "full") as full:
        fill(full)
        line = crash_line(bundle, full)
    assert f"folder {full} is on a full file system (0 bytes free)" in line and "corrupt" not in line


JAVA_MAIN = """
import org.mobilemoe.MobileMoe;

public class HostileMain {
  public static void main(String[] args) {
    // args: BUNDLE; the packed-weight folder is the per-user one (MOBILE_MOE_WEIGHT_CACHE)
    try (MobileMoe model = MobileMoe.open(args[0])) {
      float[] image = new float[model.inputValues()];
      int[] argb = new int[7 * 5];
      System.out.println("classes " + model.numClasses());
      System.out.println("predict " + model.predict(image, Integer.MAX_VALUE).classes.length);
      System.out.println("argb " + model.predictArgb(argb, 7, 5, 7, Integer.MAX_VALUE).classes.length);
    }
  }
}
"""


@pytest.fixture(scope="session")
def hostile_java(library, tmp_path_factory) -> list[str]:  # noqa: F811 (the imported fixture)
    """HostileMain compiled against the binding: the java command line that runs it (a phone-sized heap)."""
    if shutil.which("javac") is None or not (library.parent / JNI_LIBRARY_NAME).is_file():
        pytest.skip("no JDK here (javac; on a fresh machine `apt-get install openjdk-17-jdk-headless`)")
    folder = tmp_path_factory.mktemp("hostile-java")
    (folder / "HostileMain.java").write_text(JAVA_MAIN)
    binding = sorted(map(str, (SOURCE_DIR / "java" / "org" / "mobilemoe").glob("*.java")))
    subprocess.run(["javac", "-d", str(folder), *binding, str(folder / "HostileMain.java")], check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    return ["java", "-Xmx64m", f"-Djava.library.path={library.parent}", "-cp", str(folder), "HostileMain"]


def run_java(java: list[str], bundle: Path, weight_cache: Path, address_space_kib: int | None = None) -> list[str]:
    limit = f"ulimit -v {address_space_kib} && " if address_space_kib else ""
    env = {**os.environ, "MOBILE_MOE_WEIGHT_CACHE": str(weight_cache)}
    result = subprocess.run(["sh", "-c", limit + 'exec "$@"', "sh", *java, str(bundle)], capture_output=True,
                            text=True, timeout=120, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr == ""
    return result.stdout.split("\n")


def test_java_top_k_of_integer_max_value_allocates_what_the_classes_hold(hostile_java, bundle, tmp_path):
    """predict and predictArgb with topK Integer.MAX_VALUE, in an address space smaller than the 16 GB that k ints and
    floats would take: every class, most probable first, and no OutOfMemoryError."""
    said = dict(line.split(" ", 1) for line in run_java(hostile_java, bundle, tmp_path / "w", 6 << 20) if line)
    assert said["predict"] == said["argb"] == said["classes"]


def test_java_on_a_full_disk_answers_instead_of_the_jvms_fatal_error(hostile_java, bundle, tmp_path):
    with small_file_system(tmp_path / "full") as full:
        said = dict(line.split(" ", 1) for line in run_java(hostile_java, bundle, full) if line)
    assert said["predict"] == said["classes"]


def test_bench_onto_a_full_disk_is_one_line_and_leaves_nothing(bundle, tmp_path, capsys):
    """`bench --out` on a full file system: exit 2 and one line naming the folder, nothing half-written there."""
    from mobile_moe.app.cli import main

    with small_file_system(tmp_path / "full", size="64k") as full:
        fill(full)
        argv = ["bench", str(bundle), "--runtime", "executorch", "--images", "2", "--out", str(full / "out")]
        assert main(argv) == 2
        said = capsys.readouterr().err.strip().splitlines()[-1]
        assert said.startswith(f"mobile-moe bench: error: cannot write {full / 'out'}: No space left on device")
        assert [path.name for path in full.iterdir()] == ["filler"]
