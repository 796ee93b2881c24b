"""`mobile-moe demo`: the main job on built-in data. For now: the paper's model grid and the split of ViT-Ti/32.

Later stages (training, super-classes, export, benchmarks) extend this as their packages land.
"""

from __future__ import annotations

import argparse

from mobile_moe.config import make_config
from mobile_moe.costs import costs

GRID_DEPTHS = (12, 9, 6)
GRID_WIDTHS = (384, 192, 96, 64)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="demo-out", help="directory for the demo's outputs (default: demo-out)")


def print_cost_table() -> None:
    """The paper's Fig. 3a grid: dense ViT vs Mobile V-MoE (E=10, k=1, L=2), patch 32, 224 px, 1000 classes."""
    print("Model grid (Fig. 3a of the paper): patch 32, 224 px, 1000 classes, MoE E=10 k=1 L=2")
    print(
        f"{'size':>8} {'dense FLOPs':>12} {'MoE FLOPs':>11} {'dense params':>13} {'MoE total':>10} {'MoE active':>11}"
    )
    for depth in GRID_DEPTHS:
        for width in GRID_WIDTHS:
            size = f"{depth}x{width}"
            dense = costs(make_config("vit", size))
            moe = costs(make_config("mobile-vmoe", size))
            print(
                f"{size:>8} {dense.flops / 1e6:>11.0f}M {moe.flops / 1e6:>10.0f}M {dense.params_total / 1e6:>12.2f}M "
                f"{moe.params_total / 1e6:>9.2f}M {moe.params_active / 1e6:>10.2f}M"
            )


def check_split_reproduces_model() -> None:
    """Build ViT-Ti/32 Mobile V-MoE; show that router stage + the chosen expert's path reproduce the model's logits."""
    import torch

    from mobile_moe.registry import create_model

    torch.manual_seed(0)
    model = create_model("mobile-vmoe", "12x192").eval()
    images = torch.randn(4, 3, 224, 224)
    with torch.no_grad():
        whole = model(images)
        tokens, routing = model.router_stage(images)
        chained = torch.cat(
            [
                model.expert_path(int(routing.experts[i, 0]))(tokens[i : i + 1], routing.gates[i : i + 1])
                for i in range(len(images))
            ]
        )
    error = (whole.logits - chained).abs().max().item()
    print(
        f"\nViT-Ti/32 Mobile V-MoE on 4 random images: experts chosen {routing.experts[:, 0].tolist()}, "
        f"router stage + expert path vs whole model: max |logit difference| = {error:.2e}"
    )


def run(args: argparse.Namespace) -> None:
    print_cost_table()
    check_split_reproduces_model()
