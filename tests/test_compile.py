"""torch.compile of every registry model's training forward: one graph, no graph breaks, no recompiles when the
routing changes, and the same numbers as eager. Dynamo's own counters; the aot_eager backend (dynamo and AOT
autograd, no code generation) keeps it fast on 2 cores: graph breaks and recompiles happen above the backend."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model
from torch._dynamo.utils import counters

from mobile_moe.models.moe import compile_model
from mobile_moe.models.registry import list_models
from mobile_moe.training.routing import TrainingForward

pytestmark = pytest.mark.usefixtures("one_thread")


def loss_of(output) -> torch.Tensor:
    """Every output the training loss reads: logits, router logits, auxiliary loss."""
    loss = output.logits.square().mean()
    if output.routing is not None:
        loss = loss + output.routing.logits.square().mean()
    if output.stats is not None:
        loss = loss + output.stats.aux_loss
    return loss


def spread_the_routing(model) -> None:
    """An untrained router sends every image to one expert: make the images of the test batches spread out."""
    with torch.no_grad():
        if model.config.routing == "cluster":  # k-means centroids: the features of four of the images
            images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(99))
            router = model.router
            router.set_clusters(router.pca_mean, router.pca_components, router.project(model.image_features(images)))
            return
        for key, tensor in model.named_parameters():
            if "router" in key and tensor.ndim == 2:  # the projections; a large bias would pick one expert
                tensor.copy_(10 * torch.randn(tensor.shape, generator=torch.Generator().manual_seed(0)))


def compiled_against_eager(
    name: str, device: torch.device, backend: str, tolerance: float | None, **overrides
) -> set[tuple[int, ...]]:
    """Train steps of `name`'s tiny model compiled and of its copy eager, on the same batches and router noise: equal
    logits each step and equal gradients at the end, ONE graph compiled, no graph break; -> the routing patterns.

    `tolerance` None: the compiled numbers must be as close to eager's as eager's are to a float64 run of the same
    steps (twice that error: each side may carry its own), the bound that fp32 arithmetic itself sets, TF32 included.
    """
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(name, **overrides).train()
    spread_the_routing(model)
    model = model.to(device)
    eager = copy.deepcopy(model)
    exact = copy.deepcopy(model).double() if tolerance is None else None
    compiled = compile_model(TrainingForward(model), backend=backend)
    patterns = set()
    for seed in range(4):  # each batch routes differently: new expert group sizes, some of them 0 or 1
        images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(seed)).to(device)
        outputs = []
        for run, batch in ((compiled, images), (eager, images), (exact, images.double())):
            if run is not None:
                torch.manual_seed(seed)  # the routers' training noise, drawn alike in each
                outputs.append(run(batch))
                loss_of(outputs[-1]).backward()
        assert_near(*(output.logits for output in outputs), tolerance=tolerance, name="logits")
        assert counters["stats"]["unique_graphs"] == 1  # compiled at the first step, never again
        if outputs[0].routing is not None:
            patterns.add(tuple(torch.bincount(outputs[0].routing.experts.flatten(), minlength=4).tolist()))
    runs = [run.named_parameters() for run in (model, eager, exact) if run is not None]
    for (key, param), (_, reference), *truth in zip(*runs, strict=True):
        if reference.grad is not None:
            assert_near(param.grad, reference.grad, *(p.grad for _, p in truth), tolerance=tolerance, name=key)
    assert dict(counters["graph_break"]) == {}
    return patterns


def assert_near(
    got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor | None = None, *, tolerance, name, floor: float = 0.0
) -> None:
    """got == want within `tolerance` (relative, and absolute; gradients' rtol 10x), or, given the float64 `truth`,
    within twice want's own distance from it, plus `floor` times truth's largest magnitude (a rounding unit every
    tensor of the step carries, however close want happens to land)."""
    if truth is None:
        rtol = tolerance if name == "logits" else 10 * tolerance
        torch.testing.assert_close(got, want, atol=tolerance, rtol=rtol, msg=name)
        return
    own_error = (want.double() - truth).abs().max().item()
    difference = (got.double() - want.double()).abs().max().item()
    bound = 2 * own_error + floor * truth.abs().max().item() + 1e-7
    message = f"{name}: compiled-eager {difference:.3g}, eager's own {own_error:.3g}, bound {bound:.3g}"
    assert difference <= bound, message


# The fast set keeps one model per dispatch: dense, Mobile V-MoE's per-image experts, V-MoE's index dispatch and Soft
# MoE's dense one. WideNet and Experts Choice share V-MoE's dispatch; dynamo traces Hard MoE's E whole expert blocks
# one by one (7 s on 2 cores).
SLOW_TO_COMPILE = ("hard-moe", "widenet", "experts-choice")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_TO_COMPILE else n
                                  for n in list_models()])  # fmt: skip
def test_compiled_training_forward_is_one_graph_that_never_recompiles(name):
    patterns = compiled_against_eager(name, torch.device("cpu"), "aot_eager", tolerance=1e-5)
    config = tiny_model(name).config
    if config.is_moe and config.per_image:
        assert len(patterns) > 1  # the routing did change between steps
