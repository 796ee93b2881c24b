"""Cost accounting against a hand count, the real modules, and torch's FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mobile_moe.costs import costs
from mobile_moe.registry import make_config
from tests.conftest import TINY, TINY_MOE, tiny_model


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


def _cpu_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """torch's FLOP counter knows the CUDA attention kernels but not the CPU one: Q K^T plus A V, 2 per MAC."""
    batch, heads, queries, head_dim = query
    keys = key[-2]
    return 2 * batch * heads * queries * keys * head_dim + 2 * batch * heads * queries * keys * value[-1]


CPU_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}


@pytest.mark.parametrize("pool", ["cls", "mean"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_counts_match_the_modules(model_name, pool, top_k):
    overrides = {"pool": pool} if model_name == "vit" else {"pool": pool, "top_k": top_k}
    model = tiny_model(model_name, **overrides).eval()
    c = costs(model.config)
    assert c.params_total == sum(p.numel() for p in model.parameters())
    if model_name == "mobile-vmoe" and top_k == 1:
        # One image needs exactly the router stage and one expert's path: that is what a phone loads.
        held = {id(p): p for m in (model.router_stage, model.expert_path(0)) for p in m.parameters()}
        assert c.params_active == sum(p.numel() for p in held.values())
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter, torch.no_grad():
        model(torch.randn(1, 3, 32, 32))  # one image: grouped dispatch runs exactly its k experts
    assert c.flops == counter.get_total_flops()


def test_paper_deit_ti_moe_counts():
    # Sec. 3.2: DeiT-Ti/16 with E=10, L=2 and k=2 activates 6.31M parameters per image; 11.05M in total.
    c = costs(make_config("mobile-vmoe", "deit-ti", top_k=2))
    assert round(c.params_active / 1e6, 2) == 6.31
    assert round(c.params_total / 1e6, 2) == 11.05
