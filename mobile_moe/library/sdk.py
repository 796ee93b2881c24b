"""The SDK folder an app ships and builds against (`mobile-moe sdk --out DIR`), for this machine (linux-x86_64 or
linux-aarch64, the executorch wheel's runtime), or with `--target linux-arm64` for a Linux ARM64 device (a Raspberry
Pi, a Jetson, an i.MX board: the cross build of cross.py, with executorch's aarch64 wheel's runtime; no Java):

    DIR/include/mobile_moe.h                 the public header; mobile_moe_measure.h beside it (stats, explicit
                                             expert loads: what a benchmark reads)
    DIR/lib/libmobile_moe.so.MAJOR(.MINOR.PATCH), libmobile_moe.so
                                             the library (SOVERSION MAJOR, RUNPATH $ORIGIN) and, beside it, the
                                             ExecuTorch libraries it needs (runtime, thread pool, XNNPACK, optimized
                                             kernels), nothing from this project's environment
    DIR/lib/libmobile_moe_jni.so             the Java binding's JNI part (where a JDK was found)
    DIR/lib/pkgconfig/mobile_moe.pc          `pkg-config --cflags --libs mobile_moe`, relative to itself
    DIR/lib/cmake/mobile_moe/                `find_package(mobile_moe)`: the target mobile_moe::mobile_moe
    DIR/java/mobile-moe.jar, mobile-moe-sources.jar
                                             org.mobilemoe.MobileMoe and its sources (where a JDK was found)
    DIR/examples/app_example.c, Makefile     an app, built by `make -C DIR/examples` against DIR alone
    DIR/source/                              the library's CMake project, for machines this SDK was not built for
                                             (Android: source/build_android.sh, with the NDK)
    DIR/README.md                            how to build, ship and use it (libmobile_moe/sdk/README.md)

The folder is relocatable: everything in it finds the rest relative to itself.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from mobile_moe.errors import UsageError
from mobile_moe.library import cross
from mobile_moe.library.build import SOURCE_DIR, CrossBuild, build_library, executorch_package_dir
from mobile_moe.utils.atomic import atomic_path, check_output_folder, check_writable
from mobile_moe.utils.interrupts import run_child

# What an SDK folder holds (a rebuilt one is ours to replace).
SDK_ENTRIES = {"include", "lib", "java", "examples", "source", "README.md"}
BUILD_JAR = SOURCE_DIR / "java" / "build_jar.sh"

EXAMPLE_MAKEFILE = """\
# The example app, built against this SDK folder alone: `make` here (pkg-config finds ../lib/pkgconfig). The app
# finds the library through its RUNPATH, $ORIGIN/../lib: move the whole folder and it still runs. An app that ships
# the libraries beside its binary links with -Wl,-rpath,'$$ORIGIN' instead.
PKG_CONFIG_PATH := $(CURDIR)/../lib/pkgconfig
export PKG_CONFIG_PATH
CC ?= cc

mobile_moe_app: app_example.c
\t$(CC) -O2 -Wall -o $@ $< $$(pkg-config --cflags --libs mobile_moe) -Wl,-rpath,'$$ORIGIN/../lib'
"""

README_TEMPLATE = SOURCE_DIR / "sdk" / "README.md"  # the SDK's README: {version}, {major} and {machine} filled in


def needed_libraries(library: Path) -> list[str]:
    """The shared libraries `library` names (ELF DT_NEEDED), as readelf lists them."""
    if shutil.which("readelf") is None:
        raise UsageError("readelf (GNU binutils, which the C++ compiler comes with) is not on PATH; install binutils")
    listing = run_child(["readelf", "-d", str(library)], capture_output=True, text=True)
    if listing.returncode != 0:
        raise UsageError(f"cannot read {library}'s dynamic section: {listing.stderr.strip() or 'readelf failed'}")
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", listing.stdout)


def executorch_closure(library: Path, runtime_dir: Path) -> list[Path]:
    """The libraries of `runtime_dir` (the wheel's lib/) that `library` needs, directly or through one another."""
    found: dict[str, Path] = {}
    pending = [library]
    while pending:
        for name in needed_libraries(pending.pop()):
            candidate = runtime_dir / name
            if name not in found and candidate.is_file():
                found[name] = candidate
                pending.append(candidate)
    return sorted(found.values())


def write_jar(staging: Path) -> bool:
    """java/mobile-moe.jar, by the binding's own jar build (java/build_jar.sh); False where there is no JDK (javac,
    jar)."""
    if shutil.which("javac") is None or shutil.which("jar") is None:
        return False
    (staging / "java").mkdir()
    result = run_child(["bash", str(BUILD_JAR), str(staging / "java" / "mobile-moe.jar")], capture_output=True,
                       text=True)  # fmt: skip
    if result.returncode != 0:
        raise UsageError(f"building the Java binding failed: {(result.stderr or result.stdout).strip()[:300]}")
    sources = staging / "java" / "mobile-moe-sources.jar"
    result = run_child(["jar", "cf", str(sources), "-C", str(SOURCE_DIR / "java"), "org"], capture_output=True,
                       text=True)  # fmt: skip
    if result.returncode != 0:
        raise UsageError(f"packing the Java sources failed: {(result.stderr or result.stdout).strip()[:300]}")
    return True


def install_library(build_dir: Path, staging: Path, runtime_dir: Path) -> None:
    """CMake's install of the library (include/, lib/ with its pkg-config and CMake files), then the ExecuTorch
    libraries of `runtime_dir` it needs beside it."""
    result = run_child(["cmake", "--install", str(build_dir), "--prefix", str(staging)], capture_output=True, text=True)
    if result.returncode != 0:
        raise UsageError(f"installing libmobile_moe failed: {(result.stderr or result.stdout).strip()[:300]}")
    for library in executorch_closure(build_dir / "libmobile_moe.so", runtime_dir):
        shutil.copy2(library, staging / "lib" / library.name)


TARGETS = ("host", cross.TARGET)


@dataclass(frozen=True)
class Target:
    """What an SDK folder is built for: its build (None: this host's), the ExecuTorch libraries shipped beside the
    library, the C compiler its README builds an app with, and the machine it names."""

    build: CrossBuild | None
    runtime_dir: Path
    compiler: str
    machine: str


def target_of(name: str) -> Target:
    if name == "host":
        machine = f"{platform.system().lower()}-{platform.machine()}"
        return Target(None, executorch_package_dir() / "lib", "cc", machine)
    if name == cross.TARGET:
        return Target(cross.cross_build(), cross.runtime_dir(), cross.COMPILER.replace("g++", "gcc"), "linux-aarch64")
    raise UsageError(f"--target {name}: choose one of {', '.join(TARGETS)}")


def write_sdk(out: str | os.PathLike, target: str = "host") -> Path:
    """The SDK folder at `out` (new, empty, or an earlier SDK folder, replaced whole) for `target` (TARGETS: this
    host, or a Linux ARM64 device by the cross build of mobile_moe/library/cross.py). -> the folder."""
    out = Path(out)
    check_writable(out, directory=True)  # a file there is refused, never replaced
    check_output_folder(out, ours=lambda path: SDK_ENTRIES if (path / "include" / "mobile_moe.h").is_file() else None,
                        kind="mobile-moe SDK folder")  # fmt: skip
    built_for = target_of(target)
    library = build_library(cross=built_for.build) if built_for.build is not None else build_library()
    version = re.search(r"libmobile_moe\.so\.(\d+)\.(\d+)\.(\d+)", " ".join(p.name for p in library.parent.iterdir()))
    if version is None:
        raise UsageError(f"the build in {library.parent} has no versioned libmobile_moe.so; remove it and build again")
    with atomic_path(out, directory=True) as staging:
        install_library(library.parent, staging, built_for.runtime_dir)
        if built_for.build is None:  # the JNI library is built for the host's JDK only
            write_jar(staging)
        examples = staging / "examples"
        examples.mkdir()
        shutil.copy2(SOURCE_DIR / "examples" / "app_example.c", examples)
        # make's built-in CC is cc, so `?=` would never give a cross build its compiler: a plain assignment does
        compiler = "CC ?= cc" if built_for.build is None else f"CC = {built_for.compiler}"
        (examples / "Makefile").write_text(EXAMPLE_MAKEFILE.replace("CC ?= cc", compiler))
        not_source = shutil.ignore_patterns("sdk", "build", "build-*", "__pycache__")
        shutil.copytree(SOURCE_DIR, staging / "source", ignore=not_source)
        fields = {"version": ".".join(version.groups()), "major": version.group(1), "machine": built_for.machine,
                  "cc": built_for.compiler}  # fmt: skip
        readme = README_TEMPLATE.read_text()
        for name, value in fields.items():  # not str.format: the README's C and CMake have braces of their own
            readme = readme.replace("{" + name + "}", value)
        (staging / "README.md").write_text(readme)
    return out

