"""torch.compile of every registry model's training forward: one graph, no graph breaks, no recompiles when the
routing changes, and the same numbers as eager. Dynamo's own counters; the aot_eager backend (dynamo and AOT
autograd, no code generation) keeps it fast on 2 cores: graph breaks and recompiles happen above the backend."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model
from torch._dynamo.utils import counters

from mobile_moe.moe import compile_model
from mobile_moe.registry import list_models
from mobile_moe.training.routing import TrainingForward

pytestmark = pytest.mark.usefixtures("one_thread")


def _loss(output) -> torch.Tensor:
    """Every output the training loss reads: logits, router logits, auxiliary loss."""
    loss = output.logits.square().mean()
    if output.routing is not None:
        loss = loss + output.routing.logits.square().mean()
    if output.stats is not None:
        loss = loss + output.stats.aux_loss
    return loss


def _spread_the_routing(model) -> None:
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


@pytest.mark.parametrize("name", list_models())
def test_compiled_training_forward_is_one_graph_that_never_recompiles(name):
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(name).train()
    _spread_the_routing(model)
    eager = copy.deepcopy(model)
    compiled = compile_model(TrainingForward(model), backend="aot_eager")
    patterns = set()
    for seed in range(4):  # each batch routes differently: new expert group sizes, some of them 0 or 1
        images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)  # the routers' training noise, drawn alike in both
        got = compiled(images)
        _loss(got).backward()
        torch.manual_seed(seed)
        want = eager(images)
        _loss(want).backward()
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
        if seed == 0:
            warm = counters["stats"]["unique_graphs"]
        if got.routing is not None:
            patterns.add(tuple(torch.bincount(got.routing.experts.flatten(), minlength=4).tolist()))
    for (key, param), (_, reference) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        if reference.grad is not None:
            torch.testing.assert_close(param.grad, reference.grad, atol=1e-5, rtol=1e-4, msg=key)
    assert dict(counters["graph_break"]) == {}
    assert warm == 1 and counters["stats"]["unique_graphs"] == 1  # no recompile after the first step
    if model.config.is_moe and model.config.per_image:
        assert len(patterns) > 1  # the routing did change between steps
