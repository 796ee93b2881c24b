"""The adb flow: push a bundle, the runner and the inputs to a phone, run there, pull the JSON back, clean up.

The runner must be an Android arm64 build of device_bench/native (see native/build_android.sh). Everything goes to
one working directory under /data/local/tmp (executable there without root), which is removed afterwards even when
the run fails. Phone numbers need a real phone; the tests drive this flow through a stand-in `adb`.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from device_bench.native import as_round_report, parse_runner_output
from device_bench.round_report import RoundReport
from device_bench.settings import Settings
from mobile_moe.errors import UsageError

DEVICE_ROOT = "/data/local/tmp"


class Adb:
    """adb, bound to one device (SERIAL, or the only one attached)."""

    def __init__(self, serial: str | None = None):
        self.executable = shutil.which("adb")
        if self.executable is None:
            raise UsageError(
                "--device android needs adb on PATH (Android platform-tools); install it or use --device host"
            )
        self.serial = serial or self._only_device()

    def _base(self) -> list[str]:
        return [self.executable, "-s", self.serial] if getattr(self, "serial", None) else [self.executable]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([*self._base(), *args], capture_output=True, text=True)
        if check and result.returncode != 0:
            raise RuntimeError(f"adb {' '.join(args[:2])} failed: {(result.stderr or result.stdout).strip()}")
        return result

    def attached(self) -> list[str]:
        """Serials adb lists as ready ("device" state); asked without -s, which would filter nothing anyway."""
        listing = subprocess.run([self.executable, "devices"], capture_output=True, text=True).stdout.splitlines()
        return [line.split()[0] for line in listing[1:] if line.strip().endswith("device")]

    def _only_device(self) -> str:
        devices = self.attached()
        if not devices:
            raise UsageError("no Android device attached (adb devices lists none); connect one with USB debugging on")
        if len(devices) > 1:
            raise UsageError(f"several Android devices attached ({', '.join(devices)}): pick one with android:SERIAL")
        return devices[0]

    def check_attached(self) -> None:
        if self.serial not in self.attached():
            raise UsageError(f"Android device {self.serial} is not attached (see `adb devices`)")


def run_on_android(
    serial: str | None, runner: str | Path, bundle: str | Path, images: str | Path | None, settings: Settings
) -> dict:
    """Run the runner on the phone against the bundle; returns its JSON (bundle paths in it are device paths)."""
    from device_bench.bundles import read_manifest

    runner = Path(runner)
    if not runner.is_file():
        raise UsageError(f"--runner {runner}: no such file; build it with device_bench/native/build_android.sh")
    read_manifest(bundle)  # the schema and every graph's sha256, before anything reaches the phone
    adb = Adb(serial)
    adb.check_attached()
    workdir = f"{DEVICE_ROOT}/mobile-moe-{uuid.uuid4().hex[:8]}"
    remote_bundle, remote_runner = f"{workdir}/bundle", f"{workdir}/mobile_moe_runner"
    remote_images = f"{workdir}/images.f32" if images is not None else None
    try:
        adb.run("shell", f"mkdir -p {shlex.quote(workdir)}")
        adb.run("push", str(bundle), remote_bundle)
        adb.run("push", str(runner), remote_runner)
        if images is not None:
            adb.run("push", str(images), remote_images)
        command = [remote_runner, "--bundle", remote_bundle, *settings.runner_flags()]
        if remote_images:
            command += ["--input", remote_images]
        # Output to a file on the phone and pull it: adb shell mangles long stdout lines on some devices.
        shell = f"chmod 755 {remote_runner} && {shlex.join(command)} > {workdir}/result.json 2> {workdir}/stderr.txt"
        status = adb.run("shell", f"{shell}; echo exit=$?", check=False)
        returncode = int(status.stdout.strip().rpartition("exit=")[2] or 1)
        with tempfile.TemporaryDirectory() as local:
            adb.run("pull", f"{workdir}/result.json", f"{local}/result.json", check=False)
            adb.run("pull", f"{workdir}/stderr.txt", f"{local}/stderr.txt", check=False)
            stdout = _read(Path(local) / "result.json")
            stderr = _read(Path(local) / "stderr.txt")
        return parse_runner_output(returncode, stdout, stderr, f"runner on Android device {adb.serial}")
    finally:
        adb.run("shell", f"rm -rf {shlex.quote(workdir)}", check=False)


def _read(path: Path) -> str:
    """What the runner wrote on the phone; any bytes (a crash can leave garbage) read without failing."""
    return path.read_bytes().decode(errors="replace") if path.exists() else ""


@dataclass(frozen=True)
class AndroidRunner:
    """The native runner on a phone over adb: `binary` is an Android arm64 build; `serial` None means the only phone
    attached."""

    serial: str | None
    binary: Path

    @property
    def name(self) -> str:
        return f"native runner on Android device {self.serial or '(the one attached)'}"

    def run_round(self, bundle: Path, images: Path, settings: Settings) -> RoundReport:
        return as_round_report(run_on_android(self.serial, self.binary, bundle, images, settings))
