"""Exact parameter and FLOP counts from a config, counted as the paper counts them.

FLOPs: 2 per multiply-accumulate over every linear layer and convolution, including the attention score (Q K^T) and
weighting (A V) products; norms, softmax, GELU, biases and residual adds are not counted. The tests check these
numbers against the real modules (parameter tensors, torch.utils.flop_counter) and a hand count.

Per-token MoEs (vmoe, experts-choice, soft-moe, widenet) are counted as their evaluation-mode forward runs, per image:
the router's products, the expert MLPs on all S = E * cap buffer slots, padding included, because a static-shape graph
runs them whether a slot was filled or not, and for Soft MoE its dispatch and combine products (every token against
every slot, 2 * T * S * D each). The picking routers' dispatch and combine are a gather and a scatter-add by index
(token_moe.MoELayer): memory traffic, no products. A per-token MoE's params_active is the worst case for one image:
every expert an image can reach in each MoE layer.

Hard MoE's k-means router (PCA mean and matrix, centroids) holds non-trainable buffers; they are counted as
parameters because an exported router graph carries them like weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from mobile_moe.models.config import (
    ExpertsChoiceConfig,
    HardMoEConfig,
    MobileVMoEConfig,
    SoftMoEConfig,
    TokenMoEConfig,
    ViTConfig,
    WideNetConfig,
)


@dataclass(frozen=True)
class Costs:
    params_total: int  # every parameter of the model
    params_active: int  # what one image uses: dense part, router, and the k chosen experts' MLPs
    flops: int  # per image, 2 per multiply-accumulate


def buffer_capacity(ratio: float, top_k: int, tokens: int, experts: int) -> int:
    """Tokens one expert's buffer holds per image: ceil(C * k * T / E) (V-MoE's formula with N = 1), at most T.

    Computed on the ratio's decimal value as written, so that C = 1.05 with k T / E = 20 gives 21 slots, not the 22
    that 21.000000000000004 would round up to. The model and the cost accounting both call this one function.
    """
    num, den = Fraction(str(ratio)).as_integer_ratio()
    slots = -(-num * top_k * tokens // (den * experts))  # integer ceil: torch.compile traces it without a break
    return max(1, min(tokens, slots))


def _linear_params(fan_in: int, fan_out: int) -> int:
    return fan_in * fan_out + fan_out


def _layer_norm_params(width: int) -> int:
    return 2 * width


def mlp_params(cfg: ViTConfig, hidden: int | None = None) -> int:
    hidden = cfg.mlp_hidden if hidden is None else hidden
    return _linear_params(cfg.width, hidden) + _linear_params(hidden, cfg.width)


def _attention_params(cfg: ViTConfig) -> int:
    return _linear_params(cfg.width, 3 * cfg.width) + _linear_params(cfg.width, cfg.width)


def _block_shared_params(cfg: ViTConfig) -> int:
    """A block without its MLP: two LayerNorms and attention."""
    return 2 * _layer_norm_params(cfg.width) + _attention_params(cfg)


def _embedding_params(cfg: ViTConfig) -> int:
    patch_embed = cfg.in_chans * cfg.patch_size**2 * cfg.width + cfg.width
    class_token = cfg.width if cfg.pool == "cls" else 0
    position = cfg.num_tokens * cfg.width
    return patch_embed + class_token + position


def _head_params(cfg: ViTConfig) -> int:
    """Final LayerNorm and classifier."""
    return _layer_norm_params(cfg.width) + _linear_params(cfg.width, cfg.num_classes)


def _stem_and_head_params(cfg: ViTConfig) -> int:
    return _embedding_params(cfg) + _head_params(cfg)


def router_params(cfg: MobileVMoEConfig) -> int:
    return _layer_norm_params(cfg.width) + _linear_params(cfg.width, cfg.num_experts)


def _attention_flops(cfg: ViTConfig) -> int:
    tokens, width = cfg.num_tokens, cfg.width
    qkv = 2 * tokens * width * 3 * width
    scores = 2 * tokens * tokens * width  # all heads together: heads * T * T * head_dim
    weighting = 2 * tokens * tokens * width
    projection = 2 * tokens * width * width
    return qkv + scores + weighting + projection


def mlp_flops(cfg: ViTConfig, tokens: int | None = None, hidden: int | None = None) -> int:
    """One MLP (of `hidden` units, default mlp_hidden) on `tokens` tokens (default: the T of an image)."""
    tokens = cfg.num_tokens if tokens is None else tokens
    return 2 * 2 * tokens * cfg.width * (cfg.mlp_hidden if hidden is None else hidden)


def _embedding_flops(cfg: ViTConfig) -> int:
    return 2 * cfg.num_patches * cfg.in_chans * cfg.patch_size**2 * cfg.width


def _head_flops(cfg: ViTConfig) -> int:
    return 2 * cfg.width * cfg.num_classes


def _stem_and_head_flops(cfg: ViTConfig) -> int:
    return _embedding_flops(cfg) + _head_flops(cfg)


def params_per_expert(cfg: ViTConfig) -> int:
    """The parameters of one expert: an MLP for every MoE, a Hard MoE's last L whole blocks and head; 0 when dense.

    With the expert runs an image needed (evaluate's experts_per_image), params_total - E * expert_sets * this + runs
    * this is what that image really activated: the measured side of params_active.
    """
    if not cfg.is_moe:
        return 0
    if isinstance(cfg, HardMoEConfig):
        block = _block_shared_params(cfg) + mlp_params(cfg)
        return cfg.moe_layers * block + (0 if cfg.shared_head else _head_params(cfg))
    return mlp_params(cfg)


def costs(cfg: ViTConfig) -> Costs:
    """Parameter and FLOP counts of the model `cfg` describes."""
    if isinstance(cfg, HardMoEConfig):
        return _hard_moe_costs(cfg)
    if isinstance(cfg, WideNetConfig):
        return _widenet_costs(cfg)
    if isinstance(cfg, TokenMoEConfig):
        return _token_moe_costs(cfg)
    hidden = [cfg.mlp_hidden_of(block) for block in range(cfg.depth)]
    dense_params = _stem_and_head_params(cfg) + sum(_block_shared_params(cfg) + mlp_params(cfg, h) for h in hidden)
    dense_flops = _stem_and_head_flops(cfg) + sum(_attention_flops(cfg) + mlp_flops(cfg, hidden=h) for h in hidden)
    if not isinstance(cfg, MobileVMoEConfig):
        return Costs(params_total=dense_params, params_active=dense_params, flops=dense_flops)
    # Start from the dense model (one MLP per MoE block), then add the router and the other experts' MLPs.
    extra_active = cfg.moe_layers * (cfg.top_k - 1)
    extra_total = cfg.moe_layers * (cfg.num_experts - 1)
    router_flops = 2 * cfg.width * cfg.num_experts
    return Costs(
        params_total=dense_params + router_params(cfg) + extra_total * mlp_params(cfg),
        params_active=dense_params + router_params(cfg) + extra_active * mlp_params(cfg),
        flops=dense_flops + router_flops + extra_active * mlp_flops(cfg),
    )


def every_expert_flops(cfg: ViTConfig) -> int:
    """FLOPs per image of the one graph that runs every expert on every image and weights them by the one-hot gates:
    a per-image MoE's monolithic export (it never branches on data), E expert paths where `costs` counts k. Any other
    model's single graph computes what `costs` counts."""
    flops = costs(cfg).flops
    if isinstance(cfg, HardMoEConfig):  # each other expert's L whole blocks, and its own head unless shared
        others = cfg.num_experts - 1
        heads = 0 if cfg.shared_head else others * _head_flops(cfg)
        return flops + others * cfg.moe_layers * (_attention_flops(cfg) + mlp_flops(cfg)) + heads
    if isinstance(cfg, MobileVMoEConfig):  # the other experts' MLPs, and their outputs' weighted sum (an einsum)
        combine = 2 * cfg.num_experts * cfg.num_tokens * cfg.width
        return flops + cfg.moe_layers * ((cfg.num_experts - cfg.top_k) * mlp_flops(cfg) + combine)
    return flops


# --- per-token MoEs ----------------------------------------------------------------------------------------------


class MoELayerCosts(NamedTuple):
    """One per-token MoE layer (router and E experts; not the block's attention and norms)."""

    router_params: int
    experts_reached: int  # most distinct experts one image can use in this layer
    flops: int  # per image, evaluation mode


def eval_slots(cfg: TokenMoEConfig | WideNetConfig) -> int:
    """Buffer slots per image and MoE layer in evaluation mode, S = E * cap (Soft MoE: E * p)."""
    if isinstance(cfg, SoftMoEConfig):
        return cfg.num_experts * cfg.slots_per_expert
    top_k = 1 if isinstance(cfg, ExpertsChoiceConfig) else cfg.top_k
    return cfg.num_experts * buffer_capacity(cfg.eval_capacity_ratio, top_k, cfg.num_tokens, cfg.num_experts)


def moe_layer_costs(cfg: TokenMoEConfig | WideNetConfig) -> MoELayerCosts:
    """Router (a linear D -> E; Soft MoE: D x E*p slot parameters and a scale), dispatch, experts, combine."""
    T, D, E = cfg.num_tokens, cfg.width, cfg.num_experts
    slots = eval_slots(cfg)
    dispatch_and_combine = 0  # the picking routers': a gather and a scatter-add, no products
    if isinstance(cfg, SoftMoEConfig):
        router, router_flops, reached = D * slots + 1, 2 * T * D * slots, E
        dispatch_and_combine = 2 * (2 * T * slots * D)  # every token against every slot, each way
    else:
        router = _linear_params(D, E) if cfg.router_bias else D * E
        router_flops = 2 * T * D * E
        # Token choice: T * k (token, choice) assignments, each can reach another expert. Experts choice: every
        # expert takes cap >= 1 tokens.
        reached = E if isinstance(cfg, ExpertsChoiceConfig) else min(E, T * cfg.top_k)
    return MoELayerCosts(router, reached, router_flops + dispatch_and_combine + mlp_flops(cfg, slots))


def _token_moe_costs(cfg: TokenMoEConfig) -> Costs:
    """Dense ViT whose blocks at moe_block_indices hold an MoE layer instead of the MLP."""
    dense_blocks = cfg.dense_layers
    layer = moe_layer_costs(cfg)
    shared = _stem_and_head_params(cfg) + cfg.depth * _block_shared_params(cfg) + dense_blocks * mlp_params(cfg)
    flops = _stem_and_head_flops(cfg) + cfg.depth * _attention_flops(cfg) + dense_blocks * mlp_flops(cfg)
    return Costs(
        params_total=shared + cfg.moe_layers * (layer.router_params + cfg.num_experts * mlp_params(cfg)),
        params_active=shared + cfg.moe_layers * (layer.router_params + layer.experts_reached * mlp_params(cfg)),
        flops=flops + cfg.moe_layers * layer.flops,
    )


def _widenet_costs(cfg: WideNetConfig) -> Costs:
    """One attention and one MoE layer shared by all blocks: only the per-block LayerNorms grow with depth."""
    layer = moe_layer_costs(cfg)
    shared = _stem_and_head_params(cfg) + _attention_params(cfg) + cfg.depth * 2 * _layer_norm_params(cfg.width)
    return Costs(
        params_total=shared + layer.router_params + cfg.num_experts * mlp_params(cfg),
        params_active=shared + layer.router_params + layer.experts_reached * mlp_params(cfg),
        flops=_stem_and_head_flops(cfg) + cfg.depth * (_attention_flops(cfg) + layer.flops),
    )


# --- Hard MoE ----------------------------------------------------------------------------------------------------


def hard_moe_router_params(cfg: HardMoEConfig) -> int:
    """PCA (mean D, matrix pca_dims x D) and E centroids in the PCA space; pca_dims 0: centroids in R^D, no PCA.

    Non-trainable buffers, counted as parameters (they are weights of the exported router graph).
    """
    if cfg.pca_dims == 0:
        return cfg.num_experts * cfg.width
    return cfg.width + cfg.pca_dims * cfg.width + cfg.num_experts * cfg.pca_dims


def _hard_moe_router_flops(cfg: HardMoEConfig) -> int:
    """Projection of the pooled feature onto the principal components, then distances to the E centroids."""
    if cfg.pca_dims == 0:
        return 2 * cfg.num_experts * cfg.width
    return 2 * cfg.pca_dims * cfg.width + 2 * cfg.num_experts * cfg.pca_dims


def _hard_moe_costs(cfg: HardMoEConfig) -> Costs:
    """Trunk (embedding, depth - L dense blocks) -> k-means router -> ONE expert: L whole blocks and its own final
    norm and head, or one final norm and head shared by every expert (shared_head)."""
    block_params = _block_shared_params(cfg) + mlp_params(cfg)
    block_flops = _attention_flops(cfg) + mlp_flops(cfg)
    trunk = _embedding_params(cfg) + cfg.dense_layers * block_params
    router = hard_moe_router_params(cfg)
    expert = params_per_expert(cfg)
    shared_head = _head_params(cfg) if cfg.shared_head else 0
    return Costs(
        params_total=trunk + router + cfg.num_experts * expert + shared_head,
        params_active=trunk + router + expert + shared_head,
        flops=_embedding_flops(cfg)
        + cfg.dense_layers * block_flops
        + _hard_moe_router_flops(cfg)
        + cfg.moe_layers * block_flops
        + _head_flops(cfg),
    )
