"""libmobile_moe for a Linux ARM64 machine (a Raspberry Pi, a Jetson, an i.MX board; the emulated phone of
mobile_moe/device_bench/arm64.py): the library's CMakeLists.txt with cmake/linux-arm64.toolchain.cmake (Debian's
g++-aarch64-linux-gnu) against executorch's manylinux aarch64 wheel (runtime, XNNPACK delegate with its NEON kernels,
optimized kernels), which `fetch_wheel` downloads from the package registry and unpacks into the toolkit's cache.
build.py caches the build like the host's; `mobile-moe sdk --target linux-arm64` makes an SDK folder of it.

    make arm64      # Debian's cross compiler and qemu-user, the wheel, then the emulated device's tests
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from mobile_moe.errors import UsageError
from mobile_moe.library.build import SOURCE_DIR, CrossBuild
from mobile_moe.utils.atomic import atomic_path
from mobile_moe.utils.cache import cache_root
from mobile_moe.utils.interrupts import run_child

TARGET = "linux-arm64"
COMPILER = "aarch64-linux-gnu-g++"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # Debian's aarch64 glibc and libstdc++ (pulled in by the cross compiler)
TOOLCHAIN_FILE = SOURCE_DIR / "cmake" / "linux-arm64.toolchain.cmake"
WHEEL_PLATFORM = "manylinux_2_28_aarch64"
SETUP = "run `make arm64` (installs g++-aarch64-linux-gnu and qemu-user-static, fetches executorch's aarch64 wheel)"


def executorch_version() -> str:
    from executorch.version import __version__

    return __version__.split("+")[0]  # "1.5.1+cpu": the wheel on the registry is plain 1.5.1


def wheel_dir() -> Path:
    """Where the unpacked aarch64 wheel lives: its executorch/ directory is the cross build's CMAKE_PREFIX_PATH."""
    return cache_root() / f"executorch-{executorch_version()}-{WHEEL_PLATFORM}"


def missing() -> list[str]:
    """What building for linux-arm64 needs and this machine lacks (empty: it can build)."""
    absent = [] if shutil.which("cmake") else ["cmake"]
    absent += [] if shutil.which(COMPILER) else [f"{COMPILER} (Debian package g++-aarch64-linux-gnu)"]
    absent += [] if (SYSROOT / "lib" / "ld-linux-aarch64.so.1").exists() else [f"the aarch64 C runtime in {SYSROOT}"]
    absent += [] if (wheel_dir() / "executorch" / "lib").is_dir() else [f"executorch's aarch64 wheel in {wheel_dir()}"]
    return absent


def fetch_wheel() -> Path:
    """Download executorch's aarch64 wheel of this executorch version (pip download: no install) and unpack it into
    wheel_dir(), whole or not at all; -> wheel_dir(). Does nothing when it is there already."""
    target = wheel_dir()
    if target.is_dir():
        return target
    with atomic_path(target, directory=True) as unpacked, tempfile.TemporaryDirectory() as download:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                   "--platform", WHEEL_PLATFORM, f"executorch=={executorch_version()}", "--dest", download]  # fmt: skip
        result = run_child(command, capture_output=True, text=True)
        wheels = list(Path(download).glob("executorch-*.whl"))
        if result.returncode != 0 or not wheels:
            reason = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise UsageError(f"cannot download executorch's {WHEEL_PLATFORM} wheel: {reason[0]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(unpacked)
    return target


def runtime_dir() -> Path:
    """The wheel's shared libraries, which a linux-arm64 build of the library loads."""
    return wheel_dir() / "executorch" / "lib"


def runtime_libraries() -> tuple[Path, ...]:
    return tuple(sorted(runtime_dir().glob("*.so")))


def cross_build() -> CrossBuild:
    """The linux-arm64 build: executorch's aarch64 wheel, Debian's cross compiler through the toolchain file; refused
    in a line when the toolchain or the wheel is absent. Build paths into this machine's wheel are left out of the
    binaries (CMAKE_SKIP_BUILD_RPATH); the library's install keeps its RUNPATH $ORIGIN."""
    absent = missing()
    if absent:
        raise UsageError(f"building for {TARGET} needs {', '.join(absent)}; {SETUP}")
    cmake_args = (f"-DCMAKE_TOOLCHAIN_FILE={TOOLCHAIN_FILE}", "-DCMAKE_SKIP_BUILD_RPATH=ON")
    return CrossBuild(TARGET, wheel_dir() / "executorch", cmake_args, shutil.which(COMPILER) or COMPILER)
