"""`mobile-moe info`: a model's parameter and FLOP counts, from its config alone (no weights are built)."""

from __future__ import annotations

import argparse
import json

from mobile_moe.models.cli_args import add_model_arguments, config_from_args
from mobile_moe.models.config import ViTConfig
from mobile_moe.models.costs import costs, params_per_expert


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")


# What one routing decision is about, per routing kind (config.MoEConfig)
ROUTED_ITEM = {"image": "per image", "cluster": "per image", "token": "per token", "expert": "experts choose tokens",
               "soft": "soft, every expert"}  # fmt: skip


def describe(cfg: ViTConfig) -> str:
    """e.g. `mobile-vmoe 12x192/32 @224, 1000 classes, E=10 k=1 L=2 (per image)`."""
    text = f"{cfg.name} {cfg.depth}x{cfg.width}/{cfg.patch_size} @{cfg.image_size}, {cfg.num_classes} classes"
    if cfg.is_moe:
        k = f" k={cfg.top_k}" if hasattr(cfg, "top_k") else ""
        text += f", E={cfg.num_experts}{k} L={cfg.moe_layers} ({ROUTED_ITEM[cfg.routing]})"
    return text


def info_dict(cfg: ViTConfig) -> dict:
    """params_active: per image, the worst case for per-token routers; params_shared / params_per_expert: what every
    image needs, and one expert (an image needs evaluate's experts_per_image of them)."""
    counts = costs(cfg)
    per_expert = params_per_expert(cfg)
    experts_held = cfg.num_experts * cfg.expert_sets if cfg.is_moe else 0
    return {
        "model": cfg.name,
        "routing": cfg.routing,
        "params_total": counts.params_total,
        "params_active": counts.params_active,
        "params_shared": counts.params_total - experts_held * per_expert,
        "params_per_expert": per_expert,
        "flops": counts.flops,
        "config": cfg.to_dict(),
    }


def run(args: argparse.Namespace) -> None:
    cfg = config_from_args(args)
    info = info_dict(cfg)
    if args.json:
        print(json.dumps(info))
        return
    print(describe(cfg))
    print(f"  params total   {info['params_total'] / 1e6:9.2f} M  ({info['params_total']:,})")
    per_image = "per image" if not cfg.is_moe or cfg.per_image else "per image, at most: routing is per token"
    print(f"  params active  {info['params_active'] / 1e6:9.2f} M  ({info['params_active']:,}, {per_image})")
    print(f"  FLOPs          {info['flops'] / 1e6:9.1f} M  ({info['flops']:,}, per image, 2 per MAC)")
