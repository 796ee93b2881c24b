"""The emulated ARM64 device: the native runner cross-compiled for linux-arm64 and run on ARM instructions here.

    make arm64                                        # Debian's toolchain and qemu, executorch's aarch64 wheel, tests
    mobile-moe bench BUNDLE --device arm64-emulated   # pushes, runs and pulls exactly as --device android does

The build is mobile_moe/library/cross.py's (the library's linux-arm64 build, which `mobile-moe sdk --target
linux-arm64` makes an SDK folder of). The device: a directory that plays the phone's
filesystem (working directories under its data/local/tmp), and qemu-user running the runner there against Debian's
aarch64 C and C++ runtime, so the runner reads its bundle from the device's working directory and loads only the files
it chooses, as on a phone.

What such a run tells: parity, routing, the files opened and the bytes loaded are real ARM64 results. Latency, load
times and memory are the emulator's (JIT-translated code, qemu's own memory): marked emulated, never a phone's.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from mobile_moe.device_bench.remote import RunnerFiles, run_remote
from mobile_moe.device_bench.round_report import RoundJson
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.errors import UsageError
from mobile_moe.library import cross
from mobile_moe.library.build import build_runner
from mobile_moe.utils.atomic import scratch_folder
from mobile_moe.utils.interrupts import run_child

DEVICE = "arm64-emulated"
QEMU = ("qemu-aarch64-static", "qemu-aarch64")
# The core the device emulates: a Cortex-A76 (ARMv8.2-A with dot product and fp16: the big core of many 2019-2022
# phones), a fixed feature set that does not move with qemu's version. Not qemu's default "max": with it, int8
# bundles give wrong logits under qemu 7.2 (one class for every image), while "max,sme=off" and every concrete core
# match the host bit for bit, and fp32 is right either way. So the SME code path is at fault (XNNPACK's SME kernels, or
# qemu's emulation of SME); telling which needs SME hardware.
CPU = "cortex-a76"


def qemu() -> str | None:
    return next((path for path in map(shutil.which, QEMU) if path), None)


def missing() -> list[str]:
    """What the emulated device needs and this machine lacks (empty: it can build and run)."""
    return cross.missing() + ([] if qemu() else ["qemu-aarch64 (Debian package qemu-user-static)"])


def require() -> None:
    absent = missing()
    if absent:
        raise UsageError(f"--device {DEVICE} needs {', '.join(absent)}; {cross.SETUP}")


def build_arm64_runner() -> Path:
    """The runner built for linux-arm64 (cached like the host's)."""
    return build_runner(cross=cross.cross_build())


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
        command = [qemu(), "-cpu", CPU, "-L", str(cross.SYSROOT), *settings, *argv]
        with open(self.on_device(stdout), "wb") as out, open(self.on_device(stderr), "wb") as err:
            return run_child(command, stdout=out, stderr=err).returncode

    def remove(self, remote: str) -> None:
        shutil.rmtree(self.on_device(remote), ignore_errors=True)


def run_emulated(runner: Path | None, bundle: Path, images: Path | None, settings: RoundSettings) -> dict:
    """The cross-built runner (`runner`, or the cached build) on a fresh emulated device; -> its JSON."""
    binary = runner if runner is not None else build_arm64_runner()
    return run_remote(EmulatedArm64Device, RunnerFiles(binary, cross.runtime_libraries()), bundle, images, settings)


@dataclass(frozen=True)
class EmulatedArm64Runner:
    """The native runner on the emulated ARM64 device: `binary` is a linux-arm64 build (None: build and cache one)."""

    binary: Path | None = None

    @property
    def name(self) -> str:
        return f"native runner on the {EmulatedArm64Device.name}"

    def run_round(self, bundle: Path, images: Path, settings: RoundSettings) -> RoundJson:
        return run_emulated(self.binary, bundle, images, settings)
