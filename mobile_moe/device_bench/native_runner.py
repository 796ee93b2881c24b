"""Run the native runner on this machine and read its one JSON object.

Every way the runner can fail becomes ONE line (a UsageError, exit status 2 at the CLI): its own error line (exit 2:
bad input; exit 1: a runtime failure), a death by signal ("the native runner crashed (signal N) on BUNDLE"), a
runner that printed nothing, or a `--runner` path that is missing or not executable (refused before anything runs).
Output is decoded from bytes with errors="replace", so odd bytes on stderr never turn into a UnicodeDecodeError.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from mobile_moe.device_bench.round_report import RoundJson
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.errors import UsageError
from mobile_moe.export.manifest import read_manifest
from mobile_moe.library.binding import default_weight_cache_dir
from mobile_moe.library.build import build_runner
from mobile_moe.utils.cache import free_bytes
from mobile_moe.utils.interrupts import run_child
from mobile_moe.utils.words import shown

RUNNER_PREFIX = "mobile_moe_runner"


def runner_command(
    runner: str | Path, bundle: str | Path, images: str | Path | None, settings: RoundSettings
) -> list[str]:
    """The runner's argv: the round's settings, its library options only where they differ from the library's
    defaults (the packed-weight folder among them: left out, the library's per-user folder, as in an app)."""
    command = [os.path.abspath(runner), "--bundle", str(bundle), *settings.runner_flags()]  # "./r" is not r on PATH
    if images is not None:
        command += ["--input", str(images)]
    return command


def decode(output: bytes | str | None) -> str:
    """Process output as text: bytes decoded as UTF-8 with undecodable bytes replaced, never an exception."""
    if output is None:
        return ""
    return output if isinstance(output, str) else output.decode("utf-8", errors="replace")


def _signal_name(number: int) -> str:
    try:
        return f"signal {number}, {signal.Signals(number).name}"
    except ValueError:
        return f"signal {number}"


def full_disk_advice(weight_cache_dir: str | Path | None, bundle: str | Path | None) -> str | None:
    """Why a runner died of SIGBUS, where its packed-weight folder's file system is (nearly) full: XNNPACK writes
    packed weights through a shared mapping, which a full disk kills with SIGBUS (packed_cache.h room_for); None
    where the folder has the room the library asks for (twice the bundle's files and 4 MiB) or is unknown."""
    if not weight_cache_dir:
        return None
    folder = Path(weight_cache_dir)
    try:
        bundle_bytes = sum(f.stat().st_size for f in Path(bundle).iterdir() if f.is_file()) if bundle else 0
    except OSError:  # a bundle gone since: the folder's room alone
        bundle_bytes = 0
    room = free_bytes(folder)
    if room is None or room >= 2 * bundle_bytes + (4 << 20):
        return None
    return (f"the packed-weight cache folder {folder} is on a full file system ({room} bytes free), and XNNPACK "
            "writes packed weights through a mapping that a full disk kills; free some space there, or give "
            "--weight-cache-dir a folder with room")  # fmt: skip


def parse_runner_output(
    returncode: int,
    stdout: bytes | str,
    stderr: bytes | str,
    where: str,
    bundle: str | Path | None = None,
    weight_cache_dir: str | Path | None = None,
) -> dict:
    """The runner's JSON, or a UsageError with one line saying why there is none.

    The runner's own line (it starts with "mobile_moe_runner") is quoted when there is one; a negative returncode is
    a death by signal (a crash on this bundle, or SIGBUS while `weight_cache_dir`, the run's packed-weight folder, is
    on a full file system: full_disk_advice); a runner that printed nothing is said to have printed nothing.
    """
    stdout, stderr = decode(stdout), decode(stderr)
    on = f" on {bundle}" if bundle is not None else ""
    ours = [line.strip() for line in stderr.splitlines() if line.startswith(RUNNER_PREFIX)]
    if returncode < 0:
        detail = f": {shown(ours[-1])}" if ours else ""
        full = full_disk_advice(weight_cache_dir, bundle) if -returncode == signal.SIGBUS else None
        advice = full or "the bundle may be corrupt (re-export it)"
        raise UsageError(
            f"the {where} crashed ({_signal_name(-returncode)}){on}{detail}; {advice}; rerun with MOBILE_MOE_DEBUG=1 "
            "for the runtime's log"
        )
    if returncode != 0:
        if ours:
            message = shown(ours[-1])
        else:
            lines = [line.strip() for line in stderr.splitlines() if line.strip()]
            message = shown(lines[-1]) if lines else "it printed nothing (is it a mobile_moe_runner build?)"
        kind = "refused the bundle" if returncode == 2 else f"failed (exit status {returncode})"
        raise UsageError(f"{where} {kind}{on}: {message}")
    if not stdout.strip():
        raise UsageError(f"{where}: the runner exited 0 but printed nothing{on} (is it a mobile_moe_runner build?)")
    try:
        report = json.loads(stdout)
    except json.JSONDecodeError as error:
        raise UsageError(f"{where}: the runner printed no JSON object ({error}): {shown(stdout, 200)}") from None
    if not isinstance(report, dict):
        raise UsageError(f"{where}: the runner printed JSON that is not an object: {shown(stdout, 200)}")
    return report


def check_runner(runner: str | Path) -> Path:
    """The runner path, if it is an executable file; UsageError (before anything runs) otherwise."""
    path = Path(runner)
    if not path.exists():
        raise UsageError(f"--runner {runner}: no such file; omit --runner to build the runner for this machine")
    if not path.is_file():
        raise UsageError(f"--runner {runner}: not a file; pass the mobile_moe_runner executable")
    if not os.access(path, os.X_OK):
        raise UsageError(f"--runner {runner}: not executable (chmod +x it)")
    return path


def run_native(runner: str | Path, bundle: str | Path, images: str | Path | None, settings: RoundSettings) -> dict:
    check_runner(runner)
    # The runner checks these too (a bundle may be run by hand on a phone); checking here first gives Python's message.
    read_manifest(bundle, verify_files=True)
    command = runner_command(runner, bundle, images, settings)
    try:
        result = run_child(command, capture_output=True)
    except OSError as error:  # e.g. an Android arm64 build run on this machine: Exec format error
        raise UsageError(f"--runner {runner}: cannot run it on this machine ({error.strerror or error})") from None
    folder = None
    if result.returncode == -signal.SIGBUS:  # the packed-weight folder's file system may be full: where is it
        folder = default_weight_cache_dir() if settings.weight_cache_dir is None else settings.weight_cache_dir
    return parse_runner_output(result.returncode, result.stdout, result.stderr, "native runner", bundle, folder)


@dataclass(frozen=True)
class NativeRunner:
    """The native C++ runner on this machine: `binary`, or one built for this host on first use (cached)."""

    binary: Path | None = None

    @property
    def name(self) -> str:
        return f"native runner {self.binary}" if self.binary is not None else "native runner"

    def run_round(self, bundle: Path, images: Path, settings: RoundSettings) -> RoundJson:
        return run_native(self.binary or build_runner(), bundle, images, settings)
