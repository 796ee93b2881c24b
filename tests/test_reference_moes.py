"""The per-token reference MoEs (vmoe, experts-choice, soft-moe, widenet) against small hand-computed cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from mobile_moe.errors import UsageError
from mobile_moe.models.costs import buffer_capacity
from mobile_moe.models.moe import ExpertMLPs
from mobile_moe.models.routers import top_k
from mobile_moe.models.token_moe import MoELayer, SoftRouter, TokenChoiceRouter, TokenMoEBlock, dense_form
from mobile_moe.models.vit import Attention
from mobile_moe.utils.outputs import MoEStats

REFERENCE_MOES = ["vmoe", "experts-choice", "soft-moe", "widenet"]


def _tokens(batch: int = 3, tokens: int = 17, width: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, tokens, width, generator=torch.Generator().manual_seed(seed))


def _first_moe_layer(model) -> MoELayer:
    return next(m for m in model.modules() if isinstance(m, MoELayer))


def _slot_tokens(route, expert: int, num_tokens: int) -> list[int]:
    """The tokens in expert `expert`'s buffer of image 0, slot by slot (empty slots, which hold T, left out)."""
    return [token for token in route.tokens[0, expert].tolist() if token < num_tokens]


# --- capacity ------------------------------------------------------------------------------------------------------


def test_buffer_capacity_formula():
    assert buffer_capacity(1.05, 2, 197, 10) == 42  # ceil(41.37)
    assert buffer_capacity(1.05, 2, 100, 10) == 21  # exactly 21, though 1.05 * 2 * 100 / 10 is 21.000000000000004
    assert buffer_capacity(4.0, 2, 17, 4) == 17  # clipped to T
    assert buffer_capacity(0.01, 1, 17, 4) == 1


def test_train_and_eval_capacity_differ_by_ratio_only():
    router = TokenChoiceRouter(32, 4, 2, capacity_ratio=1.0, eval_capacity_ratio=1.5)
    assert router.capacity(17) == 9  # ceil(1.0 * 2 * 17 / 4)
    router.eval()
    assert router.capacity(17) == 13  # ceil(1.5 * 2 * 17 / 4)


# --- V-MoE ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("train", [True, False])
def test_infinite_capacity_without_noise_is_the_dense_top_k_mixture(train):
    model = tiny_model("vmoe", capacity_ratio=100.0, eval_capacity_ratio=100.0, noise_std=0.0)
    model.train(train)
    layer = _first_moe_layer(model)
    x = _tokens()
    with torch.no_grad():
        y, stats = layer(x)
        gates, experts = top_k(layer.router.proj(x).softmax(-1), 2)  # (B, T, k)
        weights = torch.zeros(3, 17, 4).scatter(-1, experts, gates)  # (B, T, E), sparse
        every_expert = torch.stack([layer.experts.expert(e)(x) for e in range(4)], 2)  # (B, T, E, D)
        reference = torch.einsum("bte,bted->btd", weights, every_expert)
    torch.testing.assert_close(y, reference, atol=1e-5, rtol=1e-5)
    assert float(stats.dropped) == 0.0
    assert stats.expert_tokens.sum(-1).tolist() == [[34.0]] * 3  # T * k slots filled per image


def _bpr_router(capacity_ratio: float, batch_prioritized: bool) -> TokenChoiceRouter:
    """E = 2, k = 2 on 2-d tokens (a, 0): logits (a, -a), so the top gate is sigmoid(2|a|), expert 0 when a > 0."""
    router = TokenChoiceRouter(2, 2, 2, capacity_ratio, capacity_ratio, batch_prioritized=batch_prioritized)
    with torch.no_grad():
        router.proj.weight.copy_(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]))
        router.proj.bias.zero_()
    return router.eval()


# Priority by |a|: token 3 (0.9), 5 (0.7), 1 (0.5), 2 (0.3), 4 (0.2), 0 (0.1). First choices: expert 0 for tokens 0, 2,
# 3, 5; expert 1 for tokens 1, 4. Every second choice is the other expert.
BPR_TOKENS = torch.tensor([0.1, -0.5, 0.3, 0.9, -0.2, 0.7]).view(1, 6, 1) * torch.tensor([1.0, 0.0])


@pytest.mark.parametrize(
    "capacity_ratio, batch_prioritized, expert0, expert1",
    [
        # cap = ceil(0.3 * 2 * 6 / 2) = 2: expert 0 keeps its two highest-priority first choices, drops tokens 2, 0.
        (0.3, True, [3, 5], [1, 4]),
        # Without BPR the buffers fill in token order: token 3, the most confident, is dropped.
        (0.3, False, [0, 2], [1, 4]),
        # cap = 3: every first choice goes before any second choice, so token 3's second choice (expert 1) queues
        # behind the first choices of the lower-priority tokens 1 and 4; token 0, the lowest priority, is dropped.
        (0.5, True, [3, 5, 2], [1, 4, 3]),
    ],
)
def test_batch_prioritized_routing_drops_the_lowest_priority(capacity_ratio, batch_prioritized, expert0, expert1):
    route = _bpr_router(capacity_ratio, batch_prioritized)(BPR_TOKENS)
    assert _slot_tokens(route, 0, 6) == expert0
    assert _slot_tokens(route, 1, 6) == expert1
    kept = len(expert0) + len(expert1)
    torch.testing.assert_close(route.stats.dropped, torch.tensor(1 - kept / 12))
    assert route.stats.expert_tokens.tolist() == [[[len(expert0), len(expert1)]]]
    # combine carries the token's gate for that expert, sigmoid(2a) for expert 0 (no renormalisation over the top k)
    first = expert0[0]
    torch.testing.assert_close(route.gates[0, 0, 0], torch.sigmoid(2 * BPR_TOKENS[0, first, 0]))


def test_batch_prioritized_ties_go_to_the_lower_index():
    route = _bpr_router(0.3, True)(torch.tensor([[[0.4, 0.0]] * 6]))  # every token alike, all prefer expert 0
    assert _slot_tokens(route, 0, 6) == [0, 1]
    assert _slot_tokens(route, 1, 6) == [0, 1]


def test_uniform_router_losses_by_hand():
    """A zero router: equal gates, so the stable top-k sends every token to experts 0 and 1 (E = 4, k = 2)."""
    vmoe = TokenChoiceRouter(32, 4, 2, 100.0, 100.0, aux_loss_weight=0.5).eval()
    switch = TokenChoiceRouter(32, 4, 2, 100.0, 100.0, balance_loss="switch", aux_loss_weight=0.5).eval()
    for router in (vmoe, switch):
        torch.nn.init.zeros_(router.proj.weight)
        torch.nn.init.zeros_(router.proj.bias)
    x = _tokens()
    # importance: equal sums -> CV^2 0; noise-free load: counts (T, T, 0, 0) -> std T/2 / mean T/2 -> 1.
    torch.testing.assert_close(vmoe(x).stats.aux_loss, torch.tensor(0.5 * (0.0 + 1.0) / 2))
    # Switch (WideNet Eq. 3-5): E * sum_e m_e P_e with P_e = 1/4 and the m_e summing to k = 2 -> 2.
    torch.testing.assert_close(switch(x).stats.aux_loss, torch.tensor(0.5 * 2.0))


def test_noisy_load_loss_has_a_gradient():
    router = TokenChoiceRouter(32, 4, 2, 1.0, 1.0, noise_std=0.25, aux_loss_weight=1.0).train()
    router(_tokens()).stats.aux_loss.backward()
    assert router.proj.weight.grad.abs().sum() > 0


def test_eval_is_deterministic_and_training_is_noisy(images):
    model = tiny_model("vmoe")
    with torch.no_grad():
        noisy = [model(images).logits for _ in range(2)]
        model.eval()
        clean = [model(images).logits for _ in range(2)]
    assert not torch.equal(noisy[0], noisy[1])
    assert torch.equal(clean[0], clean[1])


def test_noise_free_training_is_deterministic(images):
    model = tiny_model("vmoe", noise_std=0.0)
    with torch.no_grad():
        assert torch.equal(model(images).logits, model(images).logits)


@pytest.mark.parametrize("placement, indices", [("last", [1, 2]), ("every-other", [0, 2])])
def test_moe_block_placement(placement, indices):
    model = tiny_model("vmoe", moe_placement=placement, depth=4 if placement == "every-other" else 3)
    moe = [i for i, block in enumerate(model.blocks) if isinstance(block, TokenMoEBlock)]
    assert moe == model.config.moe_block_indices
    assert moe == (indices if placement == "last" else [1, 3])


# --- Experts Choice ------------------------------------------------------------------------------------------------


def test_experts_choice_fills_every_expert_to_capacity(images):
    model = tiny_model("experts-choice", capacity_ratio=1.5).train()
    router = _first_moe_layer(model).router
    cap = buffer_capacity(1.5, 1, 17, 4)  # 7
    route = router(_tokens())
    dispatch, combine = dense_form(route.tokens, route.gates, num_tokens=17)
    torch.testing.assert_close(dispatch.sum(1), torch.ones(3, 4, cap))  # every slot holds exactly one token
    assert route.stats.expert_tokens.tolist() == [[[cap] * 4]] * 3
    scores = router.proj(_tokens()).softmax(-1)  # (B, T, E)
    best = top_k(scores.transpose(1, 2), cap)[0]  # (B, E, cap): each expert's own top scores
    torch.testing.assert_close(combine.sum(1), best)
    untaken = (dispatch.sum((2, 3)) == 0).float().mean()
    torch.testing.assert_close(route.stats.dropped, untaken)
    stats = model(images).stats  # one expert set per MoE block
    assert stats.expert_tokens.tolist() == [[[cap] * 4] * 2] * 6
    assert float(stats.aux_loss) == 0.0


# --- Soft MoE ------------------------------------------------------------------------------------------------------


def test_soft_moe_dispatch_and_combine_are_distributions():
    route = SoftRouter(32, 4, 3)(_tokens())
    torch.testing.assert_close(route.dispatch.sum(1), torch.ones(3, 4, 3))  # each slot: a weighted mean of tokens
    torch.testing.assert_close(route.combine.sum((2, 3)), torch.ones(3, 17))  # each token: a weighted mean of slots
    assert route.stats.expert_tokens.tolist() == [[[3.0] * 4]] * 3
    assert float(route.stats.dropped) == float(route.stats.aux_loss) == 0.0


def test_soft_moe_is_equivariant_to_permuting_tokens():
    torch.manual_seed(0)
    layer = MoELayer(SoftRouter(32, 4, 2), ExpertMLPs(4, 32, 64))
    x = _tokens()
    perm = torch.randperm(17, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(layer(x[:, perm])[0], layer(x)[0][:, perm], atol=1e-5, rtol=1e-5)


# --- WideNet -------------------------------------------------------------------------------------------------------


def test_widenet_grows_with_depth_by_layer_norms_only():
    counts = {depth: sum(p.numel() for p in tiny_model("widenet", depth=depth).parameters()) for depth in (3, 5)}
    assert counts[5] - counts[3] == 2 * (2 * 2 * 32)  # two more blocks, two LayerNorms each, weight and bias
    model = tiny_model("widenet", depth=5)
    assert sum(isinstance(m, MoELayer) for m in model.modules()) == 1
    assert sum(isinstance(m, Attention) for m in model.modules()) == 1


def test_widenet_reports_every_block(images):
    model = tiny_model("widenet", capacity_ratio=100.0).train()
    stats = model(images).stats
    assert stats.expert_tokens.shape == (6, 1, 4)  # one expert set, shared by the 3 blocks
    assert stats.expert_tokens.sum(-1).tolist() == [[3 * 17 * 2]] * 6  # depth 3 x T x k, nothing dropped
    assert float(stats.dropped) == 0.0


# --- every reference MoE -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", REFERENCE_MOES)
def test_output_contract(name, images):
    model = tiny_model(name).eval()
    out = model(images)
    assert out.logits.shape == (6, 7) and out.routing is None
    assert isinstance(out.stats, MoEStats)
    assert out.stats.aux_loss.shape == out.stats.dropped.shape == ()
    assert out.stats.expert_tokens.shape == (6, model.config.expert_sets, 4)
    assert model.config.expert_sets == (1 if name == "widenet" else 2)
    tokens, stats = model.forward_features(images)
    assert tokens.shape == (6, 17, 32)
    torch.testing.assert_close(model.forward_head(tokens), out.logits, rtol=0, atol=0)
    torch.testing.assert_close(stats.expert_tokens, out.stats.expert_tokens, rtol=0, atol=0)


@pytest.mark.parametrize("name", REFERENCE_MOES)
def test_gradients_reach_the_routers_and_every_parameter(name):
    model = tiny_model(name, **({"capacity_ratio": 4.0} if name != "soft-moe" else {}))
    images = torch.randn(24, 3, 32, 32, generator=torch.Generator().manual_seed(0))  # enough tokens for every expert
    out = model(images)
    (F.cross_entropy(out.logits, torch.arange(24) % 7) + out.stats.aux_loss).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    assert any("router" in n for n, _ in model.named_parameters())


class _Exportable(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, images):
        out = self.model(images)
        return (out.logits, *out.stats)


@pytest.mark.parametrize("name", REFERENCE_MOES)
def test_torch_export_at_batch_one(name):
    model = tiny_model(name).eval()
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    program = torch.export.export(_Exportable(model), (image,), strict=False)
    other = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(5))  # not the traced example
    with torch.no_grad():
        for got, want in zip(program.module()(other), _Exportable(model)(other), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("name", "biased"), [("vmoe", False), ("experts-choice", False), ("widenet", True)])
def test_routers_have_a_bias_only_where_their_papers_do(name, biased):
    """g(x) = TOP_k(softmax(W x)) as in the paper and vmoe; WideNet's router keeps its bias. A family property, no
    option: a config that names router_bias is refused."""
    from mobile_moe.models.costs import costs
    from mobile_moe.models.registry import model_from_config_dict

    model = tiny_model(name)
    router_biases = [n for n, _ in model.named_parameters() if "router" in n and n.endswith("bias")]
    assert bool(router_biases) == biased and "router_bias" not in model.config.to_dict()
    assert costs(model.config).params_total == sum(p.numel() for p in model.parameters())
    with pytest.raises(UsageError, match=f"model '{name}' has no option router_bias"):
        model_from_config_dict({**model.config.to_dict(), "router_bias": True})


def _dense_einsums(layer: MoELayer, x: torch.Tensor, route) -> torch.Tensor:
    """GShard's dispatch and combine einsums on the route's dense form: what the layer computed before it went by
    index."""
    dispatch, combine = dense_form(route.tokens, route.gates, num_tokens=x.shape[1])
    buffers = torch.einsum("btec,btd->ebcd", dispatch, x)
    E, B, capacity, D = buffers.shape
    outputs = layer.experts.buffers_forward(buffers.reshape(E, B * capacity, D)).view(E, B, capacity, D)
    return torch.einsum("btec,ebcd->btd", combine, outputs)


@pytest.mark.parametrize("name", ["vmoe", "experts-choice", "widenet"])
@pytest.mark.parametrize("train", [True, False])
def test_dispatch_by_index_equals_the_dense_einsums(name, train):
    """The gather and scatter-add compute GShard's one-hot einsums, values and gradients (k = 2, tokens dropped at
    capacity 0.5, experts choice's tokens taken by several experts or none)."""
    layer = _first_moe_layer(tiny_model(name, capacity_ratio=0.5, eval_capacity_ratio=0.5).train(train))
    x = _tokens().requires_grad_()
    route = layer.router(x)  # one route (one draw of the training noise) for both
    if name != "experts-choice":
        assert float(route.stats.dropped) > 0, "precondition: some tokens find their buffers full"
    by_index, dense = layer.by_index(x, route), _dense_einsums(layer, x, route)
    torch.testing.assert_close(by_index, dense, atol=1e-6, rtol=1e-5)
    weights = torch.randn(dense.shape, generator=torch.Generator().manual_seed(3))
    grads = [torch.autograd.grad((y * weights).sum(), [x, *layer.parameters()], retain_graph=True)
             for y in (by_index, dense)]
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


# --- routing groups (routing_group_images) ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["vmoe", "experts-choice"])
def test_routing_groups_train_together_and_evaluate_alone(name, images):
    """While training, 3 images of 6 share each MoE layer's buffers (capacity counted over 3 * T tokens); in eval
    mode each image is routed alone, so a batch's outputs are each image's own and the same as per-image routing."""
    grouped, alone = tiny_model(name, routing_group_images=3), tiny_model(name)
    alone.load_state_dict(grouped.state_dict())
    layer = _first_moe_layer(grouped)
    seen = []
    layer.router.register_forward_hook(lambda module, args, route: seen.append(args[0].shape))
    grouped.train()(images)
    tokens = grouped.config.num_tokens
    assert seen[0] == (2, 3 * tokens, grouped.config.width)
    grouped.eval(), alone.eval()
    with torch.no_grad():
        batch = grouped(images).logits
        one_by_one = torch.cat([grouped(image[None]).logits for image in images])
        torch.testing.assert_close(batch, one_by_one, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batch, alone(images).logits, rtol=0, atol=0)
    assert seen[-1][0] == 1  # the last eval call routed one image


def test_routing_groups_must_divide_the_batch(images):
    model = tiny_model("vmoe", routing_group_images=4).train()
    with pytest.raises(ValueError, match="routing groups of 4"):
        model(images)  # 6 images


@pytest.mark.parametrize("name", ["vmoe", "experts-choice", "mobile-vmoe"])
def test_a_config_states_every_field_at_its_default_too_and_reads_back_as_itself(name):
    """config.json's model (and a bundle manifest's) holds every field of the config, routing_group_images and
    router_block at their defaults included, and reads back as the same config."""
    import dataclasses

    from mobile_moe.models.registry import config_from_dict

    config = tiny_model(name).config
    written = config.to_dict()
    assert set(written) == {"name", *(field.name for field in dataclasses.fields(config))}
    assert written.get("routing_group_images", 1) == 1 and written.get("router_block") is None
    assert config_from_dict(written) == config
    assert tiny_model("vmoe", routing_group_images=8).config.to_dict()["routing_group_images"] == 8
