"""What only a CUDA device can check (`make gpu-check` runs these first; `make test` deselects them)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_compile import compiled_against_eager, loss_of

from mobile_moe.app.cli import main
from mobile_moe.training.evaluate import autocast
from mobile_moe.training.run_dir import load_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("name", ["vit", "mobile-vmoe", "vmoe", "hard-moe"])
def test_inductor_compiled_cuda_training_is_one_graph_equal_to_eager(name):
    compiled_against_eager(name, CUDA, "inductor", tolerance=1e-4)


@pytest.mark.parametrize("name", ["vit", "mobile-vmoe"])
def test_a_bf16_autocast_step_is_finite_and_keeps_float32_weights(name):
    model = tiny_model(name).to(CUDA).train()
    with autocast(CUDA):
        output = model(torch.randn(8, 3, 32, 32, device=CUDA))
    assert output.logits.dtype == torch.bfloat16
    loss_of(output).float().backward()
    assert all(
        p.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None
    )


def test_a_run_trained_on_cuda_resumes_and_evaluates_on_a_cpu(tmp_path):
    """Checkpoints hold CPU tensors whatever trained them (map_location on load), and the run goes on on a CPU."""
    argv = ["train", "--model", "mobile-vmoe", "--size", "3x64", "--patch", "8", "--image-size", "32",
            "--experts", "3", "--data", "synthetic:classes=6,super=3,per_class=30", "--super-classes", "truth",
            "--recipe", "tiny", "--batch-size", "16", "--quiet", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main([*argv, "--epochs", "1", "--device", "cuda"]) == 0
    assert main([*argv, "--epochs", "2", "--device", "cpu"]) == 0
    run = load_run(tmp_path / "run", "last")
    assert run.checkpoint["epoch"] == 2
    assert all(value.device.type == "cpu" for value in run.model.state_dict().values())
