"""Run the native runner on this machine and read its one JSON object."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from device_bench.settings import Settings
from mobile_moe.errors import UsageError


def runner_command(runner: str | Path, bundle: str | Path, images: str | Path | None, settings: Settings) -> list[str]:
    command = [str(runner), "--bundle", str(bundle), *settings.runner_flags()]
    if images is not None:
        command += ["--input", str(images)]
    return command


def parse_runner_output(returncode: int, stdout: str, stderr: str, where: str) -> dict:
    """The runner's JSON, or an error: its exit status 2 means bad input (UsageError), anything else a failure."""
    if returncode != 0:
        lines = [line for line in stderr.splitlines() if line.startswith("mobile_moe_runner")]
        message = lines[-1] if lines else (stderr.strip().splitlines() or ["no output"])[-1]
        if returncode == 2:
            raise UsageError(f"{where}: {message}")
        raise RuntimeError(f"{where}: runner exited with status {returncode}: {message}")
    try:
        return json.loads(stdout)
    except json.JSONDecodeError as error:
        raise RuntimeError(f"{where}: runner printed no JSON object ({error}): {stdout[:200]!r}") from error


def run_native(runner: str | Path, bundle: str | Path, images: str | Path | None, settings: Settings) -> dict:
    result = subprocess.run(runner_command(runner, bundle, images, settings), capture_output=True, text=True)
    return parse_runner_output(result.returncode, result.stdout, result.stderr, "native runner")
