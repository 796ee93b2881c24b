"""Behaviour of every registered model: shapes, gradients, routing, dispatch, and the export split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import spread_clusters, tiny_model

from mobile_moe.models import moe
from mobile_moe.models.checkpoint import checkpoint_dict, load_checkpoint, model_from_checkpoint, save_checkpoint
from mobile_moe.models.registry import MODELS


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_forward_shapes_and_finite(model_name, images, pool):
    model = tiny_model(model_name, pool=pool)
    out = model(images)
    assert out.logits.shape == (6, 7)
    assert torch.isfinite(out.logits).all()
    cfg = model.config
    if not cfg.is_moe:
        assert out.routing is None and out.stats is None
    elif not cfg.per_image:
        assert out.routing is None
        assert out.stats.expert_tokens.shape == (6, cfg.expert_sets, 4)
        assert out.stats.aux_loss.shape == out.stats.dropped.shape == ()
    else:
        routing = out.routing
        assert routing.logits.shape == routing.probs.shape == (6, 4)
        assert routing.experts.shape == routing.gates.shape == (6, 1)
        assert routing.experts.dtype == torch.int64
        torch.testing.assert_close(routing.probs.sum(-1), torch.ones(6))
        torch.testing.assert_close(routing.gates[:, 0], routing.probs.max(-1).values)


def test_every_parameter_gets_a_gradient(model_name, images):
    # Enough images that every expert is chosen at least once; the router learns through the router loss.
    if model_name == "hard-moe":
        pytest.skip("frozen gater and fixed k-means router: tests/test_hard_moe.py checks which parameters train")
    routing = MODELS[model_name].routing
    # Mean pooling: under a class token, a last-block expert that takes no class token rightly gets no gradient.
    model = tiny_model(model_name, pool="mean", **({"top_k": 4} if routing in ("image", "token") else {}))
    out = model(images)
    loss = F.cross_entropy(out.logits, torch.arange(6) % 7)
    if out.routing is not None:
        loss = loss + 0.3 * F.cross_entropy(out.routing.logits, torch.arange(6) % 4)
    if out.stats is not None:
        loss = loss + out.stats.aux_loss
    loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_k_equals_e_is_a_dense_mixture(images):
    model = tiny_model("mobile-vmoe", top_k=4).eval()
    with torch.no_grad():
        grouped = model(images)
        assert sorted(grouped.routing.experts[0].tolist()) == [0, 1, 2, 3]
        reference = model(images, dispatch="dense").logits  # every expert on every image (dense_mixture)
        torch.testing.assert_close(grouped.logits, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("name", "top_k"), [("mobile-vmoe", 1), ("mobile-vmoe", 2), ("hard-moe", 1)])
def test_the_unstacked_export_view_is_the_model_bit_for_bit_and_copies_no_weight(images, name, top_k):
    """The single-graph export traces each expert as a dense module over views of the stacks (XNNPACK delegates a
    linear whose weight is a parameter of its own Linear): the same values, the same arithmetic, the model left as it
    was. Mobile V-MoE's expert MLPs; a Hard MoE's whole blocks and heads."""
    model = tiny_model(name, **({"top_k": top_k} if name == "mobile-vmoe" else {})).eval()
    if name == "hard-moe":
        spread_clusters(model, images)
    view = moe.unstacked_view(model)
    stacks = {p.untyped_storage().data_ptr() for p in model.parameters()}
    experts = [p for name, p in view.named_parameters() if ".dense." in name]
    # Each of the 4 experts' tensors: Mobile V-MoE's MLP (4) in each of 2 MoE blocks; a Hard MoE's 2 whole blocks (12
    # each) and its head (4).
    per_expert = 2 * 12 + 4 if name == "hard-moe" else 2 * 4
    assert len(experts) == 4 * per_expert
    assert {p.untyped_storage().data_ptr() for p in experts} <= stacks
    assert not any(isinstance(m, moe.UnstackedModules) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(view(images, dispatch="dense"), model(images, dispatch="dense"), rtol=0, atol=0)
    if name == "mobile-vmoe":
        experts = next(m for m in view.modules() if isinstance(m, moe.UnstackedExperts))
        with pytest.raises(ValueError, match="runs the dense dispatch only"):
            experts(torch.zeros(2, 5, 32), torch.zeros(2, top_k, dtype=torch.long), torch.ones(2, top_k), "grouped")


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_grouped_dispatch_equals_per_image_loop(images, top_k):
    model = tiny_model("mobile-vmoe", top_k=top_k).eval()
    with torch.no_grad():
        batched = model(images).logits
        one_by_one = torch.cat([model(image[None]).logits for image in images])
    torch.testing.assert_close(batched, one_by_one, atol=1e-5, rtol=1e-5)


def test_grouped_dispatch_runs_each_expert_once_on_its_group(images, monkeypatch):
    model = tiny_model("mobile-vmoe", num_experts=5).eval()
    sizes: list[int] = []  # the items of each expert MLP run, in the order they ran
    run = moe.StackedModules._run

    def counting(self, tensors, x):
        sizes.append(x.shape[0])
        return run(self, tensors, x)

    monkeypatch.setattr(moe.StackedModules, "_run", counting)
    with torch.no_grad():
        routing = model(images).routing
    counts = torch.bincount(routing.experts[:, 0], minlength=5).tolist()
    assert sizes == counts * 2  # per MoE block, experts 0..4 once each: an unchosen one on no images


def test_renormalized_gates_sum_to_one(images):
    model = tiny_model("mobile-vmoe", top_k=2, renormalize_gates=True)
    torch.testing.assert_close(model(images).routing.gates.sum(-1), torch.ones(6))


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_router_stage_and_expert_path_reproduce_the_model(images, pool):
    model = tiny_model("mobile-vmoe", pool=pool).eval()
    with torch.no_grad():
        whole = model(images)
        tokens, routing = model.router_stage(images)
        chained = torch.cat(
            [
                model.expert_path(int(routing.experts[i, 0]))(tokens[i : i + 1], routing.gates[i : i + 1])
                for i in range(len(images))
            ]
        )
    torch.testing.assert_close(routing.experts, whole.routing.experts, rtol=0, atol=0)
    torch.testing.assert_close(chained, whole.logits, atol=1e-5, rtol=1e-5)


def test_expert_path_holds_only_its_own_expert():
    model = tiny_model("mobile-vmoe")
    path = model.expert_path(2)
    for block, view in zip(model.moe_blocks, path.blocks, strict=True):
        stack, mlp = block.mlp, view.mlp
        # Expert 2's slice of each stack, as a dense Mlp's Linear weights: the same memory, no copy.
        for held, whole in ((mlp.fc1.weight, stack.fc1_weight), (mlp.fc2.bias, stack.fc2_bias)):
            assert held.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        assert torch.equal(mlp.fc1.weight, stack.fc1_weight[2].T) and torch.equal(mlp.fc2.bias, stack.fc2_bias[2])
    expert_numel = sum(p[0].numel() for p in model.moe_blocks[0].mlp.parameters())  # one expert of one block
    shared = [*model.head.parameters()]
    shared += [p for block in model.moe_blocks for name, p in block.named_parameters() if not name.startswith("mlp")]
    assert sum(p.numel() for p in path.parameters()) == sum(p.numel() for p in shared) + 2 * expert_numel
    held = {id(p) for p in path.parameters()}
    assert {id(p) for p in shared} <= held  # shared, not copied
    with pytest.raises(IndexError):
        model.expert_path(4)


def test_checkpoint_round_trip(model_name, images, tmp_path):
    model = tiny_model(model_name).eval()
    save_checkpoint(checkpoint_dict(model, epoch=3), tmp_path / "ckpt.pt")
    checkpoint = load_checkpoint(tmp_path / "ckpt.pt")
    assert checkpoint["epoch"] == 3
    rebuilt = model_from_checkpoint(checkpoint).eval()
    assert rebuilt.config == model.config
    torch.testing.assert_close(rebuilt(images).logits, model(images).logits, rtol=0, atol=0)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left behind


ROUTED = ["mobile-vmoe", "hard-moe", "vmoe", "experts-choice", "widenet"]


@pytest.mark.parametrize("name", ROUTED)
def test_a_router_decides_in_fp32_under_bf16_autocast(name):
    """On the CPU; tests/test_gpu.py asks the same of cuBLAS."""
    assert_routes_in_fp32_under_bf16_autocast(name, torch.device("cpu"))


def assert_routes_in_fp32_under_bf16_autocast(name: str, device: torch.device) -> None:
    """bf16 training routes every image (token) as the float32 model and its exported router do: the router's
    projection, softmax and top-k (Hard MoE's distances) leave autocast, so their outputs are bit for bit fp32's."""
    from mobile_moe.models.hard_moe import CentroidRouter
    from mobile_moe.models.routers import PerImageRouter
    from mobile_moe.models.token_moe import ExpertsChoiceRouter, TokenChoiceRouter

    model = tiny_model(name).eval()
    router = next(m for m in model.modules() if isinstance(m, (PerImageRouter, CentroidRouter, TokenChoiceRouter,
                                                               ExpertsChoiceRouter)))  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    if isinstance(router, CentroidRouter):
        pca = router.pca_dims
        shape = router.centroids.shape
        router.set_clusters(*((torch.zeros(model.config.width), torch.eye(pca, model.config.width)) if pca
                              else (None, None)), torch.randn(shape, generator=generator))  # fmt: skip
    router = router.to(device)
    tokens = torch.randn(64, 5, model.config.width, generator=generator).to(device)
    fp32 = router(tokens)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        bf16 = router(tokens)
    for ours, theirs in zip(fp32, bf16, strict=True):
        if isinstance(ours, torch.Tensor):
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("name", ROUTED)
def test_a_float64_model_routes_in_float64(name, images):
    """The fp32 routing rule only widens: a model cast to float64 (the compile tests' reference) routes in float64."""
    model = tiny_model(name).double().eval()
    assert model(images.double()).logits.dtype == torch.float64


TOO_LARGE = [("vit", "2x8000000", {}), ("vit", "2x32", {"mlp_ratio": 1e12}),
             ("mobile-vmoe", "2x32", {"num_experts": 10**20, "moe_layers": 1})]  # fmt: skip


@pytest.mark.parametrize(("name", "size", "overrides"), TOO_LARGE)
def test_a_model_whose_weights_exceed_memory_is_refused_before_it_is_built(name, size, overrides):
    """From flags or a forged run: torch's allocator failed with a traceback, or the kernel killed the process."""
    from mobile_moe.errors import UsageError
    from mobile_moe.models.registry import create_model

    with pytest.raises(UsageError, match=r"parameters, whose weights need .* GiB, more than .* a smaller model"):
        create_model(name, size, **overrides)
