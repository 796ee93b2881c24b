"""The remote-device flow: push a bundle, the runner (with the shared libraries it needs) and the inputs to one
working directory on a device, run the runner there, pull its JSON back, remove the directory (also when the run fails).

Two devices implement RemoteDevice: an Android phone over adb (mobile_moe/device_bench/android.py) and an emulated ARM64
device (mobile_moe/device_bench/arm64.py: qemu-user running the cross-built runner against a directory that plays the
phone's filesystem). Both go through `run_remote`, so the emulated device exercises exactly the flow a phone gets.
"""

from __future__ import annotations

import dataclasses
import tempfile
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mobile_moe.device_bench.native_runner import parse_runner_output, runner_command
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.export.manifest import read_manifest

RUNNER = "mobile_moe_runner"


@dataclass(frozen=True)
class RunnerFiles:
    """A runner build for a device: the executable, and the shared libraries it loads (pushed to WORKDIR/lib and
    found through LD_LIBRARY_PATH; none for a static build such as the Android one)."""

    binary: Path
    libraries: tuple[Path, ...] = ()


class RemoteDevice(Protocol):
    """A device reached over some channel; opened as a context manager (set up, then torn down)."""

    @property
    def name(self) -> str:
        """The device in messages: "Android device SERIAL", "emulated ARM64 device (qemu-user)"."""
        ...

    @property
    def root(self) -> str:
        """The device directory working directories are made in (/data/local/tmp on a phone)."""
        ...

    def make_dir(self, remote: str) -> None: ...

    def push(self, local: Path, remote: str) -> None:
        """Copy a file or a directory tree from this machine to `remote`."""
        ...

    def pull(self, remote: str, local: Path) -> None:
        """Copy `remote` to `local` if it exists (a crashed run may not have written it)."""
        ...

    def execute(self, argv: list[str], env: dict[str, str], stdout: str, stderr: str) -> int:
        """Run `argv` (device paths; argv[0] made executable first) with `env` added, its output streams written to
        the device files `stdout` and `stderr`; -> its exit status (negative: killed by that signal)."""
        ...

    def remove(self, remote: str) -> None: ...


def run_remote(
    open_device: Callable[[], AbstractContextManager[RemoteDevice]],
    runner: RunnerFiles,
    bundle: Path,
    images: Path | None,
    settings: RoundSettings,
) -> dict:
    """Run `runner` against `bundle` on the device `open_device()` opens; -> its JSON (bundle paths in it are device
    paths). The bundle is checked (the schema, every graph's sha256) before any device is asked for."""
    read_manifest(bundle, verify_files=True)
    with open_device() as device:
        return _run_on(device, runner, bundle, images, settings)


def _run_on(
    device: RemoteDevice, runner: RunnerFiles, bundle: Path, images: Path | None, settings: RoundSettings
) -> dict:
    workdir = f"{device.root}/mobile-moe-{uuid.uuid4().hex[:8]}"
    remote_bundle, remote_runner = f"{workdir}/bundle", f"{workdir}/{RUNNER}"
    remote_images = f"{workdir}/images.f32" if images is not None else None
    try:
        device.make_dir(workdir)
        device.push(bundle, remote_bundle)
        device.push(runner.binary, remote_runner)
        if runner.libraries:
            device.make_dir(f"{workdir}/lib")
            for library in runner.libraries:
                device.push(library, f"{workdir}/lib/{library.name}")
        if remote_images is not None:
            device.push(images, remote_images)
        env = {"LD_LIBRARY_PATH": f"{workdir}/lib"} if runner.libraries else {}
        # The device's packed-weight cache outlives the run, as the cache folder an app passes does (a phone's shell
        # user has no per-user folder to default to); the library bounds it.
        if settings.weight_cache_dir is None:
            settings = dataclasses.replace(settings, weight_cache_dir=f"{device.root}/mobile-moe-weight-cache")
            device.make_dir(settings.weight_cache_dir)
        command = runner_command(remote_runner, remote_bundle, remote_images, settings)
        # Output to files on the device, then pulled: adb shell mangles long stdout lines on some devices.
        status = device.execute(command, env, f"{workdir}/result.json", f"{workdir}/stderr.txt")
        with tempfile.TemporaryDirectory() as local:
            device.pull(f"{workdir}/result.json", Path(local) / "result.json")
            device.pull(f"{workdir}/stderr.txt", Path(local) / "stderr.txt")
            stdout, stderr = _read(Path(local) / "result.json"), _read(Path(local) / "stderr.txt")
        return parse_runner_output(status, stdout, stderr, f"runner on {device.name}")
    finally:
        device.remove(workdir)


def _read(path: Path) -> bytes:
    """What the runner wrote on the device (parse_runner_output decodes any bytes: a crash can leave garbage)."""
    return path.read_bytes() if path.exists() else b""
