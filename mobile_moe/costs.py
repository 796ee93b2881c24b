"""Exact parameter and FLOP counts from a config, counted as the paper counts them.

FLOPs: 2 per multiply-accumulate over every linear layer and convolution, including the attention score (Q K^T) and
weighting (A V) products; norms, softmax, GELU, biases and residual adds are not counted. The tests check these
numbers against the real modules (parameter tensors, torch.utils.flop_counter) and a hand count.
"""

from __future__ import annotations

from dataclasses import dataclass

from mobile_moe.config import MobileVMoEConfig, ViTConfig


@dataclass(frozen=True)
class Costs:
    params_total: int  # every parameter of the model
    params_active: int  # what one image uses: dense part, router, and the k chosen experts' MLPs
    flops: int  # per image, 2 per multiply-accumulate


def _linear_params(fan_in: int, fan_out: int) -> int:
    return fan_in * fan_out + fan_out


def _layer_norm_params(width: int) -> int:
    return 2 * width


def mlp_params(cfg: ViTConfig) -> int:
    return _linear_params(cfg.width, cfg.mlp_hidden) + _linear_params(cfg.mlp_hidden, cfg.width)


def _attention_params(cfg: ViTConfig) -> int:
    return _linear_params(cfg.width, 3 * cfg.width) + _linear_params(cfg.width, cfg.width)


def _block_shared_params(cfg: ViTConfig) -> int:
    """A block without its MLP: two LayerNorms and attention."""
    return 2 * _layer_norm_params(cfg.width) + _attention_params(cfg)


def _stem_and_head_params(cfg: ViTConfig) -> int:
    patch_embed = cfg.in_chans * cfg.patch_size**2 * cfg.width + cfg.width
    class_token = cfg.width if cfg.pool == "cls" else 0
    position = cfg.num_tokens * cfg.width
    final_norm = _layer_norm_params(cfg.width)
    head = _linear_params(cfg.width, cfg.num_classes)
    return patch_embed + class_token + position + final_norm + head


def router_params(cfg: MobileVMoEConfig) -> int:
    return _layer_norm_params(cfg.width) + _linear_params(cfg.width, cfg.num_experts)


def _attention_flops(cfg: ViTConfig) -> int:
    tokens, width = cfg.num_tokens, cfg.width
    qkv = 2 * tokens * width * 3 * width
    scores = 2 * tokens * tokens * width  # all heads together: heads * T * T * head_dim
    weighting = 2 * tokens * tokens * width
    projection = 2 * tokens * width * width
    return qkv + scores + weighting + projection


def mlp_flops(cfg: ViTConfig) -> int:
    return 2 * 2 * cfg.num_tokens * cfg.width * cfg.mlp_hidden


def _stem_and_head_flops(cfg: ViTConfig) -> int:
    patch_embed = 2 * cfg.num_patches * cfg.in_chans * cfg.patch_size**2 * cfg.width
    head = 2 * cfg.width * cfg.num_classes
    return patch_embed + head


def costs(cfg: ViTConfig) -> Costs:
    """Parameter and FLOP counts of the model `cfg` describes."""
    dense_params = _stem_and_head_params(cfg) + cfg.depth * (_block_shared_params(cfg) + mlp_params(cfg))
    dense_flops = _stem_and_head_flops(cfg) + cfg.depth * (_attention_flops(cfg) + mlp_flops(cfg))
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
