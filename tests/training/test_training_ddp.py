"""Two gloo processes under torchrun on CPU end with the same weights as one process with the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mobile_moe.app.cli import main
from mobile_moe.training.run_dir import load_run

ARGS = ["train", "--model", "mobile-vmoe", "--size", "3x64", "--patch", "4", "--image-size", "16", "--experts", "3",
        "--moe-layers", "1", "--data", "synthetic:classes=6,super=3,per_class=30", "--super-classes", "truth",
        "--recipe", "tiny", "--epochs", "2", "--batch-size", "16", "--device", "cpu", "--quiet",
        "--set", "crop_scale=1"]  # no random augmentation: each process would draw its own  # fmt: skip


@pytest.mark.slow  # two torchrun processes: in CI's slow set, which keeps `make test` within 5 minutes
def test_two_gloo_processes_equal_one_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "mobile_moe", *ARGS, "--out", str(tmp_path / "ddp")]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert main([*ARGS, "--out", str(tmp_path / "single")]) == 0
    ddp, single = load_run(tmp_path / "ddp", "last"), load_run(tmp_path / "single", "last")
    assert ddp.checkpoint["epoch"] == single.checkpoint["epoch"] == 2
    width = single.config["model"]["width"]
    for key, value in single.model.state_dict().items():
        got = ddp.model.state_dict()[key]
        if key.endswith("qkv.bias"):
            # The key bias cannot change attention (softmax is shift-invariant), so its true gradient is 0 and what
            # it gets is summation-order rounding noise, which Adam normalises into lr-sized steps: loose check.
            key_bias = slice(width, 2 * width)
            torch.testing.assert_close(got[key_bias], value[key_bias], rtol=0, atol=1e-3)
            got, value = torch.cat([got[:width], got[2 * width :]]), torch.cat([value[:width], value[2 * width :]])
        torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=key)
    assert ddp.checkpoint["metrics"]["val_top1"] == single.checkpoint["metrics"]["val_top1"]
