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
    assert "Mobile V-MoE minus dense, test top-1:" in report and "ViT-Ti/32" in report


@pytest.mark.parametrize(
    "ratios, says",
    [
        ({"p50": 1.05, "peak RSS": 1.21}, "weigh on its memory: MoE / dense p50 1.05x, peak RSS 1.21x here;"),
        ({"p50": 1.32, "peak RSS": 1.21}, "the split's latency and memory approach the dense model's from a few"),
        ({"p50": 1.05, "peak RSS": 1.02}, "costs about what the dense model does already: MoE / dense p50 1.05x"),
    ],
    ids=["memory", "both", "neither"],
)
def test_the_size_sentence_names_only_the_costs_that_show(ratios, says):
    from mobile_moe.app.demo import size_sentence

    sentence = size_sentence(ratios, params=212_000)
    assert says in sentence and "1.03-1.04x p50 and 1.007x peak RSS" in sentence and "(6.1 M, 29 times" in sentence


def test_the_paired_difference_is_the_accuracy_gap_with_its_sampling_noise():
    """Image by image over one test split: the mean of (MoE right) - (dense right), and 1.96 standard errors."""
    import statistics

    from mobile_moe.training.demo import paired_difference

    assert paired_difference([True, False] * 50, [True, False] * 50) == (0.0, 0.0)  # the same answers: no noise
    dense = [True] * 80 + [False] * 20
    moe = [True] * 70 + [False] * 10 + [True] * 15 + [False] * 5  # 10 lost, 15 gained
    difference, noise = paired_difference(dense, moe)
    per_image = [0] * 70 + [-1] * 10 + [1] * 15 + [0] * 5
    assert difference == pytest.approx(0.05)
    assert noise == pytest.approx(1.96 * statistics.stdev(per_image) / 10)


def test_an_out_that_holds_files_is_refused_before_any_work(capsys, tmp_path):
    from mobile_moe.app.cli import main

    (tmp_path / "runs").mkdir()  # an earlier demo's, or the user's
    assert main(["demo", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "is not empty" in captured.err
    assert [path.name for path in tmp_path.iterdir()] == ["runs"]
