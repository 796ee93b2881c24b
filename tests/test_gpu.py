"""What only a CUDA device can check (`make gpu-check` runs these first; `make test` deselects them)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY, TINY_OPTIONS, spread_clusters, tiny_model
from test_compile import assert_near, compiled_against_eager, loss_of
from test_models import ROUTED, assert_routes_in_fp32_under_bf16_autocast

from mobile_moe.app.cli import main
from mobile_moe.moe import ExpertMLPs, compile_model, expert_groups, grouped_gemm_device, grouped_gemm_fits
from mobile_moe.training.evaluate import autocast
from mobile_moe.training.run_dir import load_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
# bf16's unit roundoff (8 significant bits): every tensor of a bf16 step carries its inputs' rounding at this size
# relative to its largest value. Without it a tensor whose errors happen to cancel in eager holds compiled to a luckier
# bound than bf16 promises: on an H200 the toy model's router norm weight, fp32 itself but fed by the bf16 trunk, had
# eager 9.1e-6 from float64 and compiled 3.4e-5 from eager, every other tensor inside twice eager's distance.
BF16 = 2.0**-8


@pytest.mark.parametrize("name", ["vit", "mobile-vmoe", "vmoe", "hard-moe"])
def test_inductor_compiled_cuda_training_is_one_graph_equal_to_eager(name):
    """Inductor's kernels round differently (fused reductions, TF32 convolutions on cuDNN): the compiled logits and
    gradients must be as close to eager's as fp32 arithmetic itself puts eager from the float64 answer."""
    quiet = {"noise_std": 0.0} if name == "vmoe" else {}  # float64 draws other noise than float32 from one seed
    compiled_against_eager(name, CUDA, "inductor", tolerance=None, **quiet)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "max-autotune"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_the_grouped_gemm_equals_the_expert_loop_forward_and_backward_in_bf16(top_k, compiled):
    """torch._grouped_mm on the stacked experts (the CUDA dispatch), eager and as inductor's max-autotune lowers it (its
    grouped-GEMM templates, forward and backward), against the per-expert loop, under bf16 autocast: outputs and every
    gradient within bf16's rounding, an expert left without items included. (The experts alone: max-autotune over a
    whole model's GEMMs took over 300 s on an H200.)"""
    if not grouped_gemm_device(torch.cuda.current_device()):
        pytest.skip("the grouped GEMM runs on sm90 only (moe.grouped_gemm_device)")
    torch.manual_seed(0)
    experts = ExpertMLPs(4, 64, 256).to(CUDA)
    x = torch.randn(32, 17, 64, device=CUDA, requires_grad=True)
    chosen = torch.randint(0, 3, (32, top_k), device=CUDA)  # expert 3 gets nothing
    gates = torch.rand(32, top_k, device=CUDA, requires_grad=True)

    def mixture(x, gates, read_sizes):
        assert grouped_gemm_fits(x, 64, 256, on_grouped_gemm_device=experts.on_grouped_gemm_device)
        return experts.mixture(x, expert_groups(chosen, gates, 4, read_sizes=read_sizes))

    torch._dynamo.reset()
    # fullgraph: a break (or a fallback to eager) fails the compile instead of quietly testing eager again
    grouped = compile_model(mixture, mode="max-autotune-no-cudagraphs", fullgraph=True) if compiled else mixture
    results = []
    for run, read_sizes in ((grouped, False), (mixture, True)):  # the grouped GEMM, then the per-expert loop
        with autocast(CUDA):
            y = run(x, gates, read_sizes)
        y.float().square().mean().backward()
        grads = [x.grad, gates.grad, *(p.grad for p in experts.parameters())]
        results.append((y.float(), [g.clone() for g in grads]))
        x.grad = gates.grad = None
        experts.zero_grad()
    (gemm, gemm_grads), (loop, loop_grads) = results
    bf16 = 2 * BF16  # two roundings of bf16's unit in each product's inputs
    torch.testing.assert_close(gemm, loop, rtol=bf16, atol=bf16 * loop.abs().max().item())
    for got, want in zip(gemm_grads, loop_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=bf16, atol=bf16 * want.abs().max().item())


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


@pytest.mark.parametrize("shape", TRAINED_SHAPES)
def test_the_compiled_bf16_training_step_runs_the_grouped_gemm_in_one_graph_and_leaves_an_empty_expert_alone(
    shape, monkeypatch
):
    """Training as it runs on an H100/H200: inductor-compiled, bf16 autocast, the grouped GEMM traced into one graph
    with no break; its logits and every gradient as close to eager bf16's as eager's are to a float64 run of the same
    step (twice that distance, each side rounding its own way, plus bf16's unit at the tensor's scale), and an expert no
    image chose gets gradients of exactly zero."""
    from torch._dynamo.utils import counters

    from mobile_moe.registry import create_model
    from mobile_moe.training.routing import TrainingForward

    if not grouped_gemm_device(torch.cuda.current_device()):
        pytest.skip("the grouped GEMM runs on sm90 only (moe.grouped_gemm_device)")
    traced = []
    real = ExpertMLPs.grouped_gemm
    monkeypatch.setattr(ExpertMLPs, "grouped_gemm", lambda *args, **kwargs: traced.append(1) or real(*args, **kwargs))
    size, fields, batch = TRAINED_SHAPES[shape]
    side, experts = fields["image_size"], fields["num_experts"]
    images = torch.randn(batch, 3, side, side, device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    labels = torch.arange(batch, device=CUDA) % (experts - 1)  # routed by label, alike in all three: the last gets none
    results = {}
    for run in ("float64", "eager", "compiled"):
        torch.manual_seed(0)
        model = create_model("mobile-vmoe", size, **fields).to(CUDA).train()
        step, batch_images = TrainingForward(model, "label"), images
        if run == "float64":  # no autocast: float64 has no grouped GEMM, so this is the per-expert loop's answer
            model.double()
            batch_images = images.double()
        torch._dynamo.reset()
        counters.clear()
        traced.clear()
        with autocast(CUDA, enabled=run != "float64"):
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


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_hard_moe_runs_its_stacked_experts_as_grouped_gemms_equal_to_its_loop_in_bf16(compiled, monkeypatch):
    """Hard MoE's stacked blocks and heads on a grouped-GEMM device under bf16 autocast (gathered norm weights,
    torch._grouped_mm for qkv, proj, fc1, fc2 and the heads, attention over the sorted batch; compiled as one graph)
    against its per-expert loop: logits and every gradient as close as the loop's own distance from a float64 run
    allows (twice that, plus bf16's unit at the tensor's scale), and an expert no image chose gets gradients of exactly
    zero on both paths."""
    from torch._dynamo.utils import counters

    from mobile_moe import hard_moe

    if not grouped_gemm_device(torch.cuda.current_device()):
        pytest.skip("the grouped GEMM runs on sm90 only (moe.grouped_gemm_device)")
    torch.manual_seed(0)
    model = tiny_model("hard-moe", pool="mean").to(CUDA).train()
    images = torch.randn(64, 3, 32, 32, device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    empty = 3
    spread_clusters(model, images, empty=empty)  # experts 0-2 get images, expert 3 none
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
        with autocast(CUDA, enabled=run != "float64"):
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


@pytest.mark.parametrize("name", ROUTED)
def test_a_router_decides_in_fp32_under_cuda_bf16_autocast(name):
    """cuBLAS under bf16 autocast: every routing decision (and the router's logits, bit for bit) is the fp32 model's."""
    assert_routes_in_fp32_under_bf16_autocast(name, CUDA)


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
    assert main([*argv, "--epochs", "2", "--device", "cpu", "--resume"]) == 0
    run = load_run(tmp_path / "run", "last")
    assert run.checkpoint["epoch"] == 2
    assert all(value.device.type == "cpu" for value in run.model.state_dict().values())


def test_batches_prepared_ahead_on_a_side_stream_are_the_ones_prepared_in_turn():
    """The thread's stream hands each batch over with an event: the step's stream reads it complete, never early."""
    from mobile_moe.data.ahead import BatchesAhead

    def prepare(step, size):
        generator = torch.Generator(CUDA).manual_seed(step)
        x = torch.randn(size, size, device=CUDA, generator=generator)
        return (x @ x @ x).tanh(), None  # long enough on the side stream that a missing wait would read it early

    results = []
    for in_thread in (False, True):
        with BatchesAhead([2048] * 6, prepare, CUDA, in_thread=in_thread) as batches:
            results.append([images.sum().item() for images, _ in batches])
    assert results[0] == results[1]
