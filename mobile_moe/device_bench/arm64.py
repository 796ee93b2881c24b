"""The emulated ARM64 device: the native runner cross-compiled for linux-arm64 and run on ARM instructions here.

    make arm64                                        # Debian's toolchain and qemu, executorch's aarch64 wheel, tests
    mobile-moe bench BUNDLE --device arm64-emulated   # pushes, runs and pulls exactly as --device android does

The build: mobile_moe/library/libmobile_moe's CMakeLists.txt with linux-arm64.toolchain.cmake (Debian's
g++-aarch64-linux-gnu) against executorch's manylinux aarch64 wheel (runtime, XNNPACK delegate with its NEON kernels,
optimized kernels), which `fetch_wheel` downloads from the package registry and unpacks into the cache;
mobile_moe.library.build caches the runner like the host one. The device: a directory that plays the phone's
filesystem (working directories under its data/local/tmp), and qemu-user running the runner there against Debian's
aarch64 C and C++ runtime, so the runner reads its bundle from the device's working directory and loads only the files
it chooses, as on a phone.

What such a run tells: parity, routing, the files opened and the bytes loaded are real ARM64 results. Latency, load
times and memory are the emulator's (JIT-translated code, qemu's own memory): marked emulated, never a phone's.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mobile_moe.atomic import atomic_path, scratch_folder
from mobile_moe.cache import cache_root
from mobile_moe.device_bench.remote import RunnerFiles, run_remote
from mobile_moe.device_bench.round_report import RoundJson
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.errors import UsageError
from mobile_moe.interrupts import run_child
from mobile_moe.library.build import SOURCE_DIR, CrossBuild, build_runner

DEVICE = "arm64-emulated"
COMPILER = "aarch64-linux-gnu-g++"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # Debian's aarch64 glibc and libstdc++ (pulled in by the cross compiler)
QEMU = ("qemu-aarch64-static", "qemu-aarch64")
# The core the device emulates: a Cortex-A76 (ARMv8.2-A with dot product and fp16: the big core of many 2019-2022
# phones), a fixed feature set that does not move with qemu's version. Not qemu's default "max": with it, int8
# bundles give wrong logits under qemu 7.2 (one class for every image), while "max,sme=off" and every concrete core
# match the host bit for bit, and fp32 is right either way. So the SME code path is at fault (XNNPACK's SME kernels, or
# qemu's emulation of SME); telling which needs SME hardware.
CPU = "cortex-a76"
TOOLCHAIN_FILE = SOURCE_DIR / "cmake" / "linux-arm64.toolchain.cmake"
WHEEL_PLATFORM = "manylinux_2_28_aarch64"
SETUP = "run `make arm64` (installs g++-aarch64-linux-gnu and qemu-user-static, fetches executorch's aarch64 wheel)"


def executorch_version() -> str:
    from executorch.version import __version__

    return __version__.split("+")[0]  # "1.5.1+cpu": the wheel on the registry is plain 1.5.1


def wheel_dir() -> Path:
    """Where the unpacked aarch64 wheel lives: its executorch/ directory is the cross build's CMAKE_PREFIX_PATH."""
    return cache_root() / f"executorch-{executorch_version()}-{WHEEL_PLATFORM}"


def qemu() -> str | None:
    return next((path for path in map(shutil.which, QEMU) if path), None)


def missing() -> list[str]:
    """What the emulated device needs and this machine lacks (empty: it can build and run)."""
    absent = [] if shutil.which("cmake") else ["cmake"]
    absent += [] if shutil.which(COMPILER) else [f"{COMPILER} (Debian package g++-aarch64-linux-gnu)"]
    absent += [] if (SYSROOT / "lib" / "ld-linux-aarch64.so.1").exists() else [f"the aarch64 C runtime in {SYSROOT}"]
    absent += [] if qemu() else ["qemu-aarch64 (Debian package qemu-user-static)"]
    absent += [] if (wheel_dir() / "executorch" / "lib").is_dir() else [f"executorch's aarch64 wheel in {wheel_dir()}"]
    return absent


def require() -> None:
    absent = missing()
    if absent:
        raise UsageError(f"--device {DEVICE} needs {', '.join(absent)}; {SETUP}")


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


def runtime_libraries() -> tuple[Path, ...]:
    """The wheel's shared libraries the runner loads: they travel with it to the device (WORKDIR/lib)."""
    return tuple(sorted((wheel_dir() / "executorch" / "lib").glob("*.so")))


def cross_build() -> CrossBuild:
    """The runner's linux-arm64 build: executorch's aarch64 wheel, Debian's cross compiler through the toolchain file;
    refused when the toolchain or wheel is absent."""
    require()
    cmake_args = (f"-DCMAKE_TOOLCHAIN_FILE={TOOLCHAIN_FILE}", "-DCMAKE_SKIP_RPATH=ON")
    return CrossBuild("linux-arm64", wheel_dir() / "executorch", cmake_args, shutil.which(COMPILER) or COMPILER)


def build_arm64_runner() -> Path:
    """The runner built for linux-arm64 (cached like the host's)."""
    return build_runner(cross=cross_build())


class EmulatedArm64Device:
    """A RemoteDevice (mobile_moe/device_bench/remote.py): a fresh directory that plays the phone's filesystem, its
    working directories under data/local/tmp as on a phone, and qemu-user running ARM64 programs in it against Debian's
    aarch64 C runtime. Device paths are this machine's paths into that directory, so what the runner reports (the
    files it holds open, read from /proc/self/fd) names them as it would on a phone. Use it in a `with` block; the
    directory is removed at its end."""

    name = f"emulated ARM64 device ({DEVICE}: qemu-user, {CPU})"

    def __enter__(self) -> EmulatedArm64Device:
        require()
        self._scratch = contextlib.ExitStack()
        self.filesystem = self._scratch.enter_context(scratch_folder("mobile-moe-arm64-device"))
        Path(self.root).mkdir(parents=True)
        return self

    def __exit__(self, *exc_info) -> None:
        self._scratch.close()

    @property
    def root(self) -> str:
        return str(self.filesystem / "data" / "local" / "tmp")

    def on_device(self, remote: str) -> Path:
        """`remote` as a path, refused unless it lies inside the device's directory (nothing else is ever touched)."""
        path = Path(remote)
        if not path.resolve().is_relative_to(self.filesystem.resolve()):
            raise ValueError(f"{remote} is not a path on the {self.name}")
        return path

    def make_dir(self, remote: str) -> None:
        self.on_device(remote).mkdir(parents=True, exist_ok=True)

    def push(self, local: Path, remote: str) -> None:
        copy = shutil.copytree if Path(local).is_dir() else shutil.copy2
        copy(local, self.on_device(remote))

    def pull(self, remote: str, local: Path) -> None:
        if self.on_device(remote).is_file():
            shutil.copy2(self.on_device(remote), local)

    def execute(self, argv: list[str], env: dict[str, str], stdout: str, stderr: str) -> int:
        self.on_device(argv[0]).chmod(0o755)
        settings = [arg for key, value in env.items() for arg in ("-E", f"{key}={value}")]
        command = [qemu(), "-cpu", CPU, "-L", str(SYSROOT), *settings, *argv]
        with open(self.on_device(stdout), "wb") as out, open(self.on_device(stderr), "wb") as err:
            return run_child(command, stdout=out, stderr=err).returncode

    def remove(self, remote: str) -> None:
        shutil.rmtree(self.on_device(remote), ignore_errors=True)


def run_emulated(runner: Path | None, bundle: Path, images: Path | None, settings: RoundSettings) -> dict:
    """The cross-built runner (`runner`, or the cached build) on a fresh emulated device; -> its JSON."""
    binary = runner if runner is not None else build_arm64_runner()
    return run_remote(EmulatedArm64Device, RunnerFiles(binary, runtime_libraries()), bundle, images, settings)


@dataclass(frozen=True)
class EmulatedArm64Runner:
    """The native runner on the emulated ARM64 device: `binary` is a linux-arm64 build (None: build and cache one)."""

    binary: Path | None = None

    @property
    def name(self) -> str:
        return f"native runner on the {EmulatedArm64Device.name}"

    def run_round(self, bundle: Path, images: Path, settings: RoundSettings) -> RoundJson:
        return run_emulated(self.binary, bundle, images, settings)
