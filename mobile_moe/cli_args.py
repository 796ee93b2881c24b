"""Model flags shared by every command that builds a model (info, train): the DESIGN.md spellings."""

from __future__ import annotations

import argparse

from mobile_moe.config import CONFIGS, PRESETS, ViTConfig, make_config


def add_model_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", required=required, choices=sorted(CONFIGS), help="registered model name")
    group.add_argument("--size", help=f"DEPTHxWIDTH from the paper's grid (e.g. 12x192) or {' / '.join(PRESETS)}")
    group.add_argument("--patch", type=int, dest="patch_size", help="patch size (default 32)")
    group.add_argument("--image-size", type=int, help="input resolution (default 224)")
    group.add_argument("--num-classes", type=int, help="classes (default 1000)")
    group.add_argument("--pool", choices=["cls", "mean"], help="class-token (default) or mean pooling")
    group.add_argument("--experts", type=int, dest="num_experts", help="E, experts per MoE block (default 10)")
    group.add_argument("--top-k", type=int, help="k, experts per image (default 1)")
    group.add_argument("--moe-layers", type=int, help="L, MoE blocks at the end (default 2)")


MOE_ONLY = ("num_experts", "top_k", "moe_layers")


def config_from_args(args: argparse.Namespace, **defaults: object) -> ViTConfig:
    """Build the config; MoE flags given to a dense model are an error rather than silently ignored."""
    from mobile_moe.errors import UsageError

    fields = {
        name: getattr(args, name)
        for name in ("patch_size", "image_size", "num_classes", "pool", *MOE_ONLY)
        if getattr(args, name, None) is not None
    }
    misplaced = [name for name in MOE_ONLY if name in fields and args.model == "vit"]
    if misplaced:
        flags = ", ".join("--" + name.replace("_", "-").replace("num-experts", "experts") for name in misplaced)
        raise UsageError(f"{flags} apply only to MoE models; drop them or use --model mobile-vmoe")
    return make_config(args.model, args.size, **{**defaults, **fields})
