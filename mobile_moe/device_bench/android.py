"""The adb flow: a phone as a remote device (mobile_moe/device_bench/remote.py pushes, runs, pulls and cleans up).

The runner must be an Android arm64 build of libmobile_moe (see its build_android.sh). Everything
goes to one working directory under /data/local/tmp (executable there without root), which is removed afterwards even
when the run fails. Phone numbers need a real phone; the tests drive this flow through a stand-in `adb`, and the same
flow runs real ARM64 code on the emulated device (mobile_moe/device_bench/arm64.py).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mobile_moe.device_bench.remote import RunnerFiles, run_remote
from mobile_moe.device_bench.round_report import RoundJson
from mobile_moe.device_bench.round_settings import RoundSettings
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


class AdbDevice:
    """A phone as a RemoteDevice (mobile_moe/device_bench/remote.py): adb push/pull, and `adb shell` for the rest."""

    root = DEVICE_ROOT

    def __init__(self, serial: str | None = None):
        self.adb = Adb(serial)
        self.adb.check_attached()

    def __enter__(self) -> AdbDevice:
        return self

    def __exit__(self, *exc_info) -> None:
        pass  # nothing to tear down: run_remote removes its working directory itself

    @property
    def name(self) -> str:
        return f"Android device {self.adb.serial}"

    def make_dir(self, remote: str) -> None:
        self.adb.run("shell", f"mkdir -p {shlex.quote(remote)}")

    def push(self, local: Path, remote: str) -> None:
        self.adb.run("push", str(local), remote)

    def pull(self, remote: str, local: Path) -> None:
        self.adb.run("pull", remote, str(local), check=False)

    def execute(self, argv: list[str], env: dict[str, str], stdout: str, stderr: str) -> int:
        assignments = " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
        command = f"{assignments} {shlex.join(argv)}".strip()
        shell = f"chmod 755 {shlex.quote(argv[0])} && {command} > {shlex.quote(stdout)} 2> {shlex.quote(stderr)}"
        status = self.adb.run("shell", f"{shell}; echo exit=$?", check=False)
        found = re.search(r"exit=(\d+)\s*$", status.stdout)
        if found is None:  # the device went away mid-run, or adb failed: no status line came back
            raise UsageError(f"{self.name} gave no exit status ({(status.stderr or status.stdout).strip()[:200]})")
        code = int(found.group(1))
        return -(code - 128) if code > 128 else code  # the shell's 128 + N: killed by signal N

    def remove(self, remote: str) -> None:
        self.adb.run("shell", f"rm -rf {shlex.quote(remote)}", check=False)


def run_on_android(
    serial: str | None, runner: str | Path, bundle: str | Path, images: str | Path | None, settings: RoundSettings
) -> dict:
    """Run the runner on the phone against the bundle; returns its JSON (bundle paths in it are device paths)."""
    runner = Path(runner)
    if not runner.is_file():
        build = "libmobile_moe/build_android.sh"
        raise UsageError(f"--runner {runner}: no such file; build it with {build}")
    images = Path(images) if images is not None else None
    return run_remote(lambda: AdbDevice(serial), RunnerFiles(runner), Path(bundle), images, settings)


@dataclass(frozen=True)
class AndroidRunner:
    """The native runner on a phone over adb: `binary` is an Android arm64 build; `serial` None means the only phone
    attached."""

    serial: str | None
    binary: Path

    @property
    def name(self) -> str:
        return f"native runner on Android device {self.serial or '(the one attached)'}"

    def run_round(self, bundle: Path, images: Path, settings: RoundSettings) -> RoundJson:
        return run_on_android(self.serial, self.binary, bundle, images, settings)
