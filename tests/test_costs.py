"""Cost accounting against a hand count, the real modules, and torch's FLOP counter."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, TINY_MOE, tiny_model
from torch.utils.flop_counter import FlopCounterMode

from mobile_moe.errors import UsageError
from mobile_moe.models.costs import buffer_capacity, costs, every_expert_flops
from mobile_moe.models.registry import MODELS, make_config


def test_hand_count_tiny_dense():
    # image 32, patch 8 -> 16 patches + cls = 17 tokens; width 32, MLP 128, depth 3, 7 classes, 3 channels.
    T, D, F, depth, K = 17, 32, 128, 3, 7
    embed_macs = 16 * (3 * 8 * 8) * D
    block_macs = T * D * 3 * D + T * T * D + T * T * D + T * D * D + 2 * T * D * F
    head_macs = D * K
    embed_params = 3 * 8 * 8 * D + D + D + T * D  # conv weight + bias, cls token, positions
    block_params = 2 * 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + (D * F + F) + (F * D + D)
    head_params = 2 * D + D * K + K
    c = costs(make_config("vit", **TINY))
    assert c.flops == 2 * (embed_macs + depth * block_macs + head_macs)
    assert c.params_total == c.params_active == embed_params + depth * block_params + head_params


def test_hand_count_tiny_moe_k2():
    dense = costs(make_config("vit", **TINY))
    moe = costs(make_config("mobile-vmoe", **{**TINY, **TINY_MOE, "top_k": 2}))
    mlp_params = 32 * 128 + 128 + 128 * 32 + 32
    mlp_flops = 2 * 2 * 17 * 32 * 128
    router_params, router_flops = 2 * 32 + 32 * 4 + 4, 2 * 32 * 4
    assert moe.params_total == dense.params_total + router_params + 2 * 3 * mlp_params  # 3 more experts x L=2
    assert moe.params_active == dense.params_active + router_params + 2 * 1 * mlp_params  # 1 more per image x L=2
    assert moe.flops == dense.flops + router_flops + 2 * mlp_flops


def _weights(model: torch.nn.Module) -> int:
    """Parameters and buffers: the only buffers are weights that are not trained (Hard MoE's PCA and centroids)."""
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())


def _cpu_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """torch's FLOP counter knows the CUDA attention kernels but not the CPU one: Q K^T plus A V, 2 per MAC."""
    batch, heads, queries, head_dim = query
    keys = key[-2]
    return 2 * batch * heads * queries * keys * head_dim + 2 * batch * heads * queries * keys * value[-1]


CPU_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}


@pytest.mark.parametrize("pool", ["cls", "mean"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_counts_match_the_modules(model_name, pool, top_k):
    # k is an option of the models that route by top-k (per image or per token); the others run once.
    has_k = MODELS[model_name].routing in ("image", "token")
    if not has_k and top_k != 1:
        pytest.skip(f"{model_name} has no top_k option")
    overrides = {"pool": pool, "top_k": top_k} if has_k else {"pool": pool}
    model = tiny_model(model_name, **overrides).eval()
    c = costs(model.config)
    assert c.params_total == _weights(model)
    if model_name == "mobile-vmoe" and top_k == 1:
        # One image needs exactly the router stage and one expert's path: that is what a phone loads.
        held = {id(p): p for m in (model.router_stage, model.expert_path(0)) for p in m.parameters()}
        assert c.params_active == sum(p.numel() for p in held.values())
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter, torch.no_grad():
        model(torch.randn(1, 3, 32, 32))  # one image: grouped dispatch runs exactly its k experts
    assert c.flops == counter.get_total_flops()


@pytest.mark.parametrize(("name", "overrides"), [("mobile-vmoe", {}), ("mobile-vmoe", {"top_k": 2}), ("hard-moe", {}),
                                                 ("hard-moe", {"shared_head": True}), ("vit", {})])  # fmt: skip
def test_every_expert_flops_are_what_the_monolithic_graph_computes(name, overrides):
    """A monolithic bundle's graph runs every expert on every image: its FLOPs, as torch's counter counts them."""
    from mobile_moe.export.graphs import split_model

    model = tiny_model(name, **overrides).eval()
    graph = split_model(model, monolithic=name != "vit").graphs[0]
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter, torch.no_grad():
        graph.module(*graph.example_inputs())
    assert every_expert_flops(model.config) == counter.get_total_flops()


def test_flops_matched_dense_counts_match_the_module():
    """Fig. 3d's dense baseline: the last 2 MLPs 3x wider; counted like the module, and the 3-expert MoE's FLOPs
    plus nothing but its router."""
    model = tiny_model("vit", wide_mlp_layers=2, wide_mlp_factor=3).eval()
    assert [block.mlp.fc1.out_features for block in model.blocks] == [128, 384, 384]
    c = costs(model.config)
    assert c.params_total == _weights(model)
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter, torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    assert c.flops == counter.get_total_flops()
    moe = costs(tiny_model("mobile-vmoe", num_experts=4, top_k=3).config)
    assert moe.flops - c.flops == 2 * 32 * 4  # the router: D x E


def test_paper_deit_ti_moe_counts():
    # Sec. 3.2: DeiT-Ti/16 with E=10, L=2 and k=2 activates 6.31M parameters per image; 11.05M in total.
    c = costs(make_config("mobile-vmoe", "deit-ti", top_k=2))
    assert round(c.params_active / 1e6, 2) == 6.31
    assert round(c.params_total / 1e6, 2) == 11.05


# --- per-token MoEs and Hard MoE -----------------------------------------------------------------------------------


def _assert_counts_match(model) -> None:
    """Parameters against the module, FLOPs against torch's counter on the eval model at batch 1."""
    model = model.eval()
    c = costs(model.config)
    assert c.params_total == sum(p.numel() for p in model.parameters())
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter, torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    assert c.flops == counter.get_total_flops()


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("vmoe", {"moe_placement": "every-other", "depth": 4}),
        ("vmoe", {"top_k": 1, "eval_capacity_ratio": 1.05, "batch_prioritized": False}),
        ("vmoe", {"eval_capacity_ratio": 100.0, "pool": "mean"}),  # capacity clipped to T
        ("experts-choice", {"eval_capacity_ratio": 0.5}),
        ("soft-moe", {"slots_per_expert": 3, "moe_layers": 3}),
        ("widenet", {"top_k": 1, "eval_capacity_ratio": 0.7}),
    ],
)
def test_per_token_counts_match_the_modules(name, overrides):
    _assert_counts_match(tiny_model(name, **overrides))


def test_hand_count_tiny_vmoe():
    """T = 17, D = 32, F = 128, E = 4, k = 2, L = 2; eval capacity ceil(4.0 * 2 * 17 / 4) = 34 -> clipped to 17."""
    dense = costs(make_config("vit", **TINY))
    vmoe = costs(make_config("vmoe", **TINY, num_experts=4, top_k=2, moe_layers=2))
    T, D, F, E, cap = 17, 32, 128, 4, 17
    mlp_params = D * F + F + F * D + D
    router_params = D * E  # no bias (vmoe's router is a dense layer without one)
    assert vmoe.params_total == dense.params_total + 2 * (router_params + (E - 1) * mlp_params)
    assert vmoe.params_active == vmoe.params_total  # 17 tokens x 2 choices can reach all 4 experts
    router, experts = 2 * T * D * E, E * cap * 4 * D * F  # dispatch and combine: by index, no products
    assert vmoe.flops == dense.flops + 2 * (router + experts - T * 4 * D * F)


def test_per_token_active_params_are_the_reachable_experts():
    # One token (a 32 px image, 32 px patch, mean pooling) with k = 2 reaches at most 2 of the 4 experts per layer.
    small = {**TINY, "patch_size": 32, "pool": "mean", "num_experts": 4, "moe_layers": 2}
    c = costs(make_config("vmoe", **small, top_k=2))
    mlp_params = 32 * 128 + 128 + 128 * 32 + 32
    assert c.params_total - c.params_active == 2 * 2 * mlp_params
    ec = costs(make_config("experts-choice", **small))  # every expert takes cap >= 1 tokens
    assert ec.params_active == ec.params_total


def test_paper_vmoe_per_token_counts():
    # Mobile V-MoEs Fig. 3e: the per-token V-MoE (DeiT-Ti/16, E=10, k=2, L=2) may use up to 11.05M per image.
    c = costs(make_config("vmoe", "deit-ti", num_experts=10, top_k=2, moe_layers=2))
    assert round(c.params_total / 1e6, 2) == 11.05
    assert c.params_active == c.params_total
    assert buffer_capacity(4.0, 2, 197, 10) == 158


def test_widenet_shares_one_layer():
    cfg = {**TINY, "num_experts": 4, "top_k": 2}
    three, five = costs(make_config("widenet", **cfg)), costs(make_config("widenet", **{**cfg, "depth": 5}))
    assert five.params_total - three.params_total == 2 * 2 * 2 * 32  # two blocks' LayerNorms
    assert five.flops > three.flops  # the shared layer runs in every block


@pytest.mark.parametrize("pca_dims, shared_head", [(8, False), (0, True)])
def test_hand_count_tiny_hard_moe(pca_dims, shared_head):
    """Trunk (embedding, 1 dense block) -> PCA + centroids -> one expert of L = 2 whole blocks (+ its head)."""
    T, D, F, K, E = 17, 32, 128, 7, 4
    embed_params = 3 * 8 * 8 * D + D + D + T * D
    block_params = 2 * 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + (D * F + F) + (F * D + D)
    head_params = 2 * D + D * K + K
    router_params = (D + pca_dims * D + E * pca_dims) if pca_dims else E * D  # buffers, counted as parameters
    expert_params = 2 * block_params + (0 if shared_head else head_params)
    shared = head_params if shared_head else 0
    block_macs = T * D * 3 * D + T * T * D + T * T * D + T * D * D + 2 * T * D * F
    router_macs = (pca_dims * D + E * pca_dims) if pca_dims else E * D
    c = costs(make_config("hard-moe", **TINY, num_experts=E, moe_layers=2, pca_dims=pca_dims, shared_head=shared_head))
    assert c.params_total == embed_params + block_params + router_params + E * expert_params + shared
    assert c.params_active == embed_params + block_params + router_params + expert_params + shared
    assert c.flops == 2 * (16 * 3 * 8 * 8 * D + 3 * block_macs + router_macs + D * K)


@pytest.mark.parametrize(
    ("name", "fields", "message"),
    [
        ("vit", {"wide_mlp_factor": 2}, "give both"),
        ("vit", {"wide_mlp_layers": 2}, "give both"),
        ("vit", {"wide_mlp_layers": 13, "wide_mlp_factor": 2}, "between 0 and depth=12"),
        ("mobile-vmoe", {"wide_mlp_layers": 2, "wide_mlp_factor": 2}, "an MoE adds experts instead"),
    ],
)
def test_wide_mlp_options_are_checked(name, fields, message):
    with pytest.raises(UsageError, match=message):
        make_config(name, "12x192", **fields)
