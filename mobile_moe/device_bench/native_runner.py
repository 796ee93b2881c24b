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

from mobile_moe.cache import packed_weights_dir
from mobile_moe.device_bench.round_report import RoundJson
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.errors import UsageError
from mobile_moe.export.manifest import read_manifest
from mobile_moe.interrupts import run_child
from mobile_moe.library.build import build_runner
from mobile_moe.words import shown

RUNNER_PREFIX = "mobile_moe_runner"


def runner_command(
    runner: str | Path,
    bundle: str | Path,
    images: str | Path | None,
    settings: RoundSettings,
    weight_cache_dir: str | Path | None = None,
) -> list[str]:
    """The runner's argv; `weight_cache_dir`: the existing directory, shared by runs, that settings.weight_cache
    keeps packed weights in (None: there is none, and the run packs on the heap)."""
    command = [os.path.abspath(runner), "--bundle", str(bundle), *settings.runner_flags()]  # "./r" is not r on PATH
    if images is not None:
        command += ["--input", str(images)]
    if settings.weight_cache and weight_cache_dir is not None:
        command += ["--weight-cache", str(weight_cache_dir)]
    else:
        command += ["--no-weight-cache"]
    if settings.park_experts is not None:
        command += ["--park-experts", str(settings.park_experts)]
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


def parse_runner_output(
    returncode: int, stdout: bytes | str, stderr: bytes | str, where: str, bundle: str | Path | None = None
) -> dict:
    """The runner's JSON, or a UsageError with one line saying why there is none.

    The runner's own line (it starts with "mobile_moe_runner") is quoted when there is one; a negative returncode is
    a death by signal (a crash on this bundle); a runner that printed nothing is said to have printed nothing.
    """
    stdout, stderr = decode(stdout), decode(stderr)
    on = f" on {bundle}" if bundle is not None else ""
    ours = [line.strip() for line in stderr.splitlines() if line.startswith(RUNNER_PREFIX)]
    if returncode < 0:
        detail = f": {shown(ours[-1])}" if ours else ""
        raise UsageError(
            f"the {where} crashed ({_signal_name(-returncode)}){on}{detail}; the bundle may be corrupt "
            "(re-export it); rerun with MOBILE_MOE_DEBUG=1 for the runtime's log"
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
    weight_cache_dir = packed_weights_dir() if settings.weight_cache else None
    command = runner_command(runner, bundle, images, settings, weight_cache_dir)
    try:
        result = run_child(command, capture_output=True)
    except OSError as error:  # e.g. an Android arm64 build run on this machine: Exec format error
        raise UsageError(f"--runner {runner}: cannot run it on this machine ({error.strerror or error})") from None
    return parse_runner_output(result.returncode, result.stdout, result.stderr, "native runner", bundle)


@dataclass(frozen=True)
class NativeRunner:
    """The native C++ runner on this machine: `binary`, or one built for this host on first use (cached)."""

    binary: Path | None = None

    @property
    def name(self) -> str:
        return f"native runner {self.binary}" if self.binary is not None else "native runner"

    def run_round(self, bundle: Path, images: Path, settings: RoundSettings) -> RoundJson:
        return run_native(self.binary or build_runner(), bundle, images, settings)
