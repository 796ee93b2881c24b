"""Training on the grouped GEMM as an H100/H200 runs it: bf16 autocast, inductor-compiled, the stacked experts on
torch._grouped_mm. tests/test_gpu.py runs these checks on CUDA's kernels where moe.grouped_gemm_device admits the GPU;
here they run on the CPU, with torch._grouped_mm's CPU fallback under CPU bf16 autocast and the device gate opened by
hand, so that the trace, the graph, the empty expert's gradients and the tolerances are checked on every change, and a
GPU's time goes to what only it can show. (Slow: inductor compiles on 2 cores.)"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY, TINY_OPTIONS, spread_clusters, tiny_model
from test_compile import assert_near, loss_of
from torch._dynamo.utils import counters

from mobile_moe.models import hard_moe
from mobile_moe.models.moe import ExpertMLPs, StackedModules, compile_model, grouped_gemm_device, grouped_gemm_fits
from mobile_moe.models.registry import create_model
from mobile_moe.training.routing import TrainingForward

# bf16's unit roundoff (8 significant bits): every tensor of a bf16 step carries its inputs' rounding at this size
# relative to its largest value. Without it a tensor whose errors happen to cancel in eager holds compiled to a luckier
# bound than bf16 promises: on an H200 the toy model's router norm weight, fp32 itself but fed by the bf16 trunk, had
# eager 9.1e-6 from float64 and compiled 3.4e-5 from eager, every other tensor inside twice eager's distance.
BF16 = 2.0**-8
CPU = torch.device("cpu")

# Mobile V-MoE as training on an H100/H200 sees it: the tests' toy shapes, and DeiT-Ti/16's (D 192, hidden 768, T 197,
# E 10, L 2) -> (create_model's size and overrides, batch).
TRAINED_SHAPES = {
    "toy": (None, TINY | TINY_OPTIONS["mobile-vmoe"], 16),
    "deit-ti": (
        "deit-ti",
        {"patch_size": 16, "image_size": 224, "num_classes": 10, "num_experts": 10, "top_k": 1, "moe_layers": 2},
        32,
    ),
}


def bf16_autocast(device: torch.device, *, enabled: bool = True):
    """Training's autocast on CUDA (training.evaluate.autocast), and the same bf16 autocast on the CPU, where training
    itself stays in float32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def on_the_grouped_gemm(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` placed on `device` with its stacked experts on the grouped-GEMM path: on CUDA where the gate admits the
    GPU (elsewhere the test skips); on the CPU the gate, which admits sm90 only, opened by hand after placement (a move
    decides it again). grouped_gemm_fits still asks for bf16 and 16-byte rows."""
    if device.type == "cuda" and not grouped_gemm_device(torch.cuda.current_device()):
        pytest.skip("the grouped GEMM runs on sm90 only (moe.grouped_gemm_device)")
    model = model.to(device)
    for module in model.modules():
        if isinstance(module, StackedModules) and device.type == "cpu":
            module.on_grouped_gemm_device = True
    return model


def assert_the_compiled_bf16_step_runs_the_grouped_gemm_in_one_graph(
    shape: str, device: torch.device, monkeypatch
) -> None:
    """Mobile V-MoE's training forward compiled under bf16 autocast: the grouped GEMM traced into one graph with no
    break; its logits and every gradient as close to eager bf16's as eager's are to a float64 run of the same step
    (twice that distance, each side rounding its own way, plus bf16's unit at the tensor's scale), and an expert no
    image chose gets gradients of exactly zero."""
    traced = []
    real = ExpertMLPs.grouped_gemm
    monkeypatch.setattr(ExpertMLPs, "grouped_gemm", lambda *args, **kwargs: traced.append(1) or real(*args, **kwargs))
    size, fields, batch = TRAINED_SHAPES[shape]
    side, experts = fields["image_size"], fields["num_experts"]
    images = torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(0)).to(device)
    labels = torch.arange(batch, device=device) % (experts - 1)  # routed by label, alike in all 3: the last gets none
    results = {}
    for run in ("float64", "eager", "compiled"):
        torch.manual_seed(0)
        model = create_model("mobile-vmoe", size, **fields).train()
        if run == "float64":  # no autocast: float64 has no grouped GEMM, so this is the per-expert loop's answer
            model, batch_images = model.to(device).double(), images.double()
        else:
            model, batch_images = on_the_grouped_gemm(model, device), images
        step = TrainingForward(model, "label")
        torch._dynamo.reset()
        counters.clear()
        traced.clear()
        with bf16_autocast(device, enabled=run != "float64"):
            output = (compile_model(step) if run == "compiled" else step)(batch_images, labels)
        loss_of(output).float().backward()
        results[run] = {"logits": output.logits} | {name: p.grad for name, p in model.named_parameters()}
        assert bool(traced) == (run != "float64"), run
        assert not counters["graph_break"], dict(counters["graph_break"])
    for name, truth in results["float64"].items():
        if truth is None:  # a parameter this step does not reach
            continue
        assert_near(results["compiled"][name], results["eager"][name], truth, tolerance=None, name=name, floor=BF16)
        if name.endswith(("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias")):
            assert all(results[run][name][experts - 1].eq(0).all() for run in results), name


def assert_hard_moe_runs_its_stacked_experts_as_grouped_gemms_equal_to_its_loop_in_bf16(
    *, compiled: bool, device: torch.device, monkeypatch
) -> None:
    """Hard MoE's stacked blocks and heads on the grouped GEMM under bf16 autocast (gathered norm weights,
    torch._grouped_mm for qkv, proj, fc1, fc2 and the heads, attention over the sorted batch; compiled as one graph)
    against its per-expert loop: logits and every gradient as close as the loop's own distance from a float64 run
    allows (twice that, plus bf16's unit at the tensor's scale), and an expert no image chose gets gradients of exactly
    zero on both paths."""
    torch.manual_seed(0)
    model = tiny_model("hard-moe", pool="mean").train()
    images = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    empty = 3
    spread_clusters(model, images, empty=empty)  # experts 0-2 get images, expert 3 none
    model, images = on_the_grouped_gemm(model, device), images.to(device)
    with torch.no_grad():
        assert set(model(images).routing.experts[:, 0].tolist()) == {0, 1, 2}
    grouped_runs = []
    real = hard_moe.ExpertBlocks.grouped
    monkeypatch.setattr(hard_moe.ExpertBlocks, "grouped", lambda *args: grouped_runs.append(1) or real(*args))
    results = {}
    for run in ("float64", "loop", "grouped"):
        torch._dynamo.reset()
        counters.clear()
        grouped_runs.clear()
        step_model, batch = (copy.deepcopy(model).double(), images.double()) if run == "float64" else (model, images)
        fits = grouped_gemm_fits if run == "grouped" else (lambda *args, **kwargs: False)  # the loop: forced
        monkeypatch.setattr(hard_moe, "grouped_gemm_fits", fits)
        forward = compile_model(step_model) if compiled and run == "grouped" else step_model
        with bf16_autocast(device, enabled=run != "float64"):
            logits = forward(batch).logits
        logits.float().square().mean().backward()
        results[run] = {"logits": logits.detach()} | {
            name: p.grad.clone() for name, p in step_model.named_parameters() if p.grad is not None
        }
        model.zero_grad()
        assert bool(grouped_runs) == (run == "grouped"), run
        assert not counters["graph_break"], dict(counters["graph_break"])
    for name, truth in results["float64"].items():
        assert_near(results["grouped"][name], results["loop"][name], truth, tolerance=None, name=name, floor=BF16)
        if name.startswith("expert"):  # a stack: the expert without images has exactly zero gradients on both paths
            assert all(results[run][name][empty].eq(0).all() for run in results), name


@pytest.mark.slow
def test_the_compiled_bf16_training_step_runs_the_grouped_gemm_in_one_graph_and_leaves_an_empty_expert_alone(
    monkeypatch,
):
    assert_the_compiled_bf16_step_runs_the_grouped_gemm_in_one_graph("toy", CPU, monkeypatch)


@pytest.mark.slow
def test_hard_moe_runs_its_stacked_experts_as_grouped_gemms_equal_to_its_loop_in_bf16(monkeypatch):
    assert_hard_moe_runs_its_stacked_experts_as_grouped_gemms_equal_to_its_loop_in_bf16(
        compiled=True, device=CPU, monkeypatch=monkeypatch
    )
