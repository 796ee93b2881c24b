"""`mobile-moe info`: a model's parameter and FLOP counts, from its config alone (no weights are built)."""

from __future__ import annotations

import argparse
import json

from mobile_moe.cli_args import add_model_arguments, config_from_args
from mobile_moe.config import MobileVMoEConfig, ViTConfig
from mobile_moe.costs import costs


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")


def describe(cfg: ViTConfig) -> str:
    """e.g. `mobile-vmoe 12x192/32 @224, 1000 classes, E=10 k=1 L=2`."""
    text = f"{cfg.name} {cfg.depth}x{cfg.width}/{cfg.patch_size} @{cfg.image_size}, {cfg.num_classes} classes"
    if isinstance(cfg, MobileVMoEConfig):
        text += f", E={cfg.num_experts} k={cfg.top_k} L={cfg.moe_layers}"
    return text


def info_dict(cfg: ViTConfig) -> dict:
    counts = costs(cfg)
    return {
        "model": cfg.name,
        "params_total": counts.params_total,
        "params_active": counts.params_active,
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
    print(f"  params active  {info['params_active'] / 1e6:9.2f} M  ({info['params_active']:,}, per image)")
    print(f"  FLOPs          {info['flops'] / 1e6:9.1f} M  ({info['flops']:,}, per image, 2 per MAC)")
