"""`mobile-moe demo` end to end, as `make demo` runs it: every stage writes its files, and stderr holds only the
toolkit's own progress lines (no third-party log line: cpuinfo probes, deprecation and library warnings)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PROGRESS = re.compile(r"epoch \d+/\d+ \d+/\d+ loss \S+ acc \S+ img_s \S+")  # mobile_moe/training/progress.py's line


@pytest.mark.slow
def test_the_demo_writes_its_report_and_its_stderr_is_only_its_own_progress(tmp_path):
    out = tmp_path / "demo-out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "mobile_moe", "demo", "--out", str(out), "--epochs", "2"],
                            capture_output=True, text=True, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    foreign = [line for line in result.stderr.splitlines() if not PROGRESS.fullmatch(line)]
    assert foreign == []
    report = (out / "report.md").read_text()
    for linked in re.findall(r"!\[[^]]*\]\(([^)]+)\)", report):  # every plot the report shows was written
        assert (out / linked).is_file(), linked
    assert {Path(p).name for p in re.findall(r"\]\(([^)]+\.png)\)", report)} >= {"latency.png", "memory.png"}
