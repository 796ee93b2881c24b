"""SIGINT, SIGTERM and SIGKILL at spread-out moments of each command that writes an output: afterwards the output is
the old one or absent, never a mixture; Ctrl-C and SIGTERM end in one line and leave no temporaries; and the same
command, run again, completes (a SIGKILLed writer's temporaries go then). Each command runs once first, uninterrupted,
to time it: the signals land at fixed fractions of that time, so they fall early (imports), midway and late (the
write) on any machine. export's and train's own cases are in tests/export/test_bundle_faults.py and
tests/training/test_training_faults.py.

Slow set: every case starts the CLI several times (seconds each, for torch's import alone)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import needs_build, source_model, tiny_model
from faults import untrained_run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# (fraction of the uninterrupted run's time, signal): every signal, early, midway and late
MOMENTS = [(0.15, signal.SIGINT), (0.5, signal.SIGTERM), (0.85, signal.SIGKILL), (0.5, signal.SIGINT)]
ONE_LINE = {signal.SIGINT: (130, "mobile-moe: interrupted"), signal.SIGTERM: (143, "mobile-moe: terminated")}


def cli(*args: object) -> list[str]:
    return [sys.executable, "-m", "mobile_moe", *map(str, args)]


def run(command: list[str]) -> float:
    """Run to the end; -> seconds taken."""
    start = time.monotonic()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return time.monotonic() - start


def files_of(out: Path) -> dict[str, bytes]:
    """What `out` holds: {name relative to it: bytes} for a folder, {"": bytes} for a file, {} when absent."""
    if out.is_file():
        return {"": out.read_bytes()}
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def temporaries(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.tmp-*"))


def interrupt(command: list[str], after_s: float, signum: int) -> None:
    """Start `command`, send `signum` after `after_s`; a stop by Ctrl-C or SIGTERM is one line and its status."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=300)
    if process.returncode == 0:
        return  # it finished first
    if signum == signal.SIGKILL:
        assert process.returncode == -signal.SIGKILL, stderr
        return
    status, line = ONE_LINE[signum]  # the last line, after whatever progress the command had logged
    assert (process.returncode, stderr.strip().splitlines()[-1]) == (status, line), stderr[-2000:]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-2000:]


def assert_signals_leave_old_or_nothing(command: list[str], out: Path, same_bytes: bool = True) -> None:
    """The first run's output stays whole through every interruption (byte for byte, or file for file where a
    rerun measures anew); then the command completes again."""
    seconds = run(command)
    old = files_of(out)
    assert old, f"precondition: {command} wrote {out}"
    for fraction, signum in MOMENTS:
        interrupt(command, fraction * seconds, signum)
        now = files_of(out)
        assert (now if same_bytes else now.keys()) == (old if same_bytes else old.keys()), (fraction, signum)
        if signum != signal.SIGKILL:
            assert temporaries(out) == [], (fraction, signum)
        run(command)
        assert temporaries(out) == [] and files_of(out).keys() == old.keys()


def assert_signals_leave_all_or_nothing(command_into, whole: Path, tmp_path: Path) -> None:
    """For a command that writes only into a new output (`command_into(out)`): each run interrupted into a new `out`
    leaves nothing there or all that the uninterrupted run wrote into `whole`, file for file; from nothing, the
    command run again completes."""
    seconds = run(command_into(whole))
    expected = files_of(whole).keys()
    for index, (fraction, signum) in enumerate(MOMENTS):
        out = tmp_path / f"interrupted-{index}"
        interrupt(command_into(out), fraction * seconds, signum)
        assert files_of(out).keys() in (set(), expected), (fraction, signum)
        if signum != signal.SIGKILL:
            assert temporaries(out) == [], (fraction, signum)
        if not out.exists():
            run(command_into(out))
        assert temporaries(out) == [] and files_of(out).keys() == expected


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory) -> Path:
    return untrained_run(tmp_path_factory.mktemp("run") / "vit", tiny_model("vit", num_classes=10))


def test_superclass_derive(dense_run, tmp_path):
    out = tmp_path / "super_classes.json"
    assert_signals_leave_old_or_nothing(cli("superclass", "derive", "--run", dense_run, "-E", 3, "--out", out), out)
    assert len(json.loads(out.read_text())["names"]) == 3


def test_import(tmp_path):
    import torch

    weights = tmp_path / "deit_tiny.pth"
    torch.save(source_model("timm:deit_tiny_patch16_224").state_dict(), weights)
    command_into = lambda out: cli("import", "timm:deit_tiny_patch16_224", "--weights", weights, "--out", out)  # noqa: E731
    assert_signals_leave_all_or_nothing(command_into, tmp_path / "whole", tmp_path)


@needs_build
def test_bench_while_the_native_runner_runs(bundle, runner, tmp_path):
    out = tmp_path / "bench"
    command = cli("bench", bundle, "--runtime", "native", "--iterations", 30, "--rounds", 2, "--pause", 0, "--out", out)
    assert_signals_leave_old_or_nothing(command, out, same_bytes=False)  # latencies differ run to run
    assert json.loads((out / "results.json").read_text())["runs"][0]["runtime"] == "native"


def test_reproduce_resumes_to_the_uninterrupted_table(tmp_path):
    """reproduce keeps what its finished cells wrote (its runs resume), so each interruption starts from nothing: the
    rerun completes and scores what the uninterrupted command scored."""
    argv = ("reproduce", "fig3b", "--data", "digits", "--scale", "tiny", "--epochs", 1)
    seconds = run(cli(*argv, "--out", tmp_path / "whole"))
    expected = (tmp_path / "whole" / "fig3b.csv").read_text()
    for index, (fraction, signum) in enumerate(MOMENTS):
        out = tmp_path / f"interrupted-{index}"
        interrupt(cli(*argv, "--out", out), fraction * seconds, signum)
        run(cli(*argv, "--out", out))
        assert (out / "fig3b.csv").read_text() == expected, (fraction, signum)
        assert temporaries(out) == [] and not list(out.rglob(".*.tmp-*"))


@pytest.mark.parametrize(("after_s", "signum"), [(6, signal.SIGTERM), (9, signal.SIGINT), (12, signal.SIGTERM)])
def test_a_stop_sent_to_a_training_runs_whole_process_group_is_one_line(tmp_path, after_s, signum):
    """A terminal's Ctrl-C and `kill -- -PGID` (a batch system's stop) reach the DataLoader's workers too: a worker
    killed by the signal made torch raise in the main process as it stopped ("DataLoader worker ... is killed by
    signal", from the loader's __del__), and the loader's pipes, closed as the stop unwound, printed OSErrors."""
    import os

    model = ["--model", "vit", "--size", "2x32", "--patch", "8", "--image-size", "32"]
    command = cli("train", *model, "--data", "digits", "--recipe", "deit", "--epochs", "50", "--workers", "4",
                  "--out", tmp_path / "run")  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    time.sleep(after_s)
    os.killpg(process.pid, signum)
    _, stderr = process.communicate(timeout=120)
    status, line = ONE_LINE[signum]
    assert (process.returncode, stderr.strip().splitlines()[-1]) == (status, line), stderr[-2000:]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-2000:]
