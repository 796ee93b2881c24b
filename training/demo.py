"""What `mobile-moe demo` calls: train a dense ViT and a Mobile V-MoE on `digits` on CPU and compare them.

from training.demo import train_digits_pair
result = train_digits_pair("demo-out/training", super_classes="random")
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from mobile_moe.config import make_config
from training import recipes
from training.run import load_run, read_metrics
from training.train import train

# The demo model: 4 blocks of width 64 (2 heads), 32 px digits in 8 px patches (16 tokens), mean pooling (learns a
# tiny dataset several epochs sooner than a class token). The MoE: E=5 experts, k=1, the last L=2 blocks.
DEMO_MODEL = {"size": "4x64", "patch_size": 8, "image_size": 32, "pool": "mean"}
DEMO_MOE = {"num_experts": 5, "top_k": 1, "moe_layers": 2}


def train_digits_pair(
    out_dir: str | os.PathLike, super_classes: str = "random", epochs: int | None = None, verbose: bool = True
) -> dict[str, Any]:
    """Train dense and Mobile V-MoE (tiny recipe, CPU) on digits into OUT/dense and OUT/moe; print and return
    {"dense": {...}, "moe": {...}}, each with run_dir, test top1/top5, router_accuracy (MoE), images_per_s (mean
    over epochs) and wall_s. `super_classes`: a super-class file from super_class/ (5 super-classes of the digits),
    or random[:SEED]."""
    from training.evaluate import evaluate

    out_dir = Path(out_dir)
    recipe = recipes.tiny().replace(device="cpu", **({"epochs": epochs} if epochs else {}))
    results: dict[str, Any] = {}
    for kind, name, extra, spec in (("dense", "vit", {}, None), ("moe", "mobile-vmoe", DEMO_MOE, super_classes)):
        size = DEMO_MODEL["size"]
        fields = {k: v for k, v in DEMO_MODEL.items() if k != "size"}
        config = make_config(name, size, num_classes=10, **fields, **extra)
        start = time.perf_counter()
        run_dir = train(config, recipe, "digits", spec, out_dir / kind, verbose=verbose)
        wall = time.perf_counter() - start
        run = load_run(run_dir)
        scores = evaluate(run.model, run.open_data().split("test"), run.super_assignment)
        rows = read_metrics(run_dir)
        results[kind] = {
            "run_dir": str(run_dir),
            "test_top1": scores["top1"],
            "test_top5": scores["top5"],
            "router_accuracy": scores["router_accuracy"],
            "expert_load": scores.get("expert_load"),
            "images_per_s": sum(r["images_per_s"] for r in rows) / len(rows),
            "wall_s": wall,
        }
    dense, moe = results["dense"], results["moe"]
    print(
        f"digits, {recipe.epochs} epochs on CPU: dense ViT test top-1 {100 * dense['test_top1']:.2f}% "
        f"({dense['images_per_s']:.0f} img/s, {dense['wall_s']:.0f} s); Mobile V-MoE (E=5, k=1, super-classes "
        f"{super_classes}) test top-1 {100 * moe['test_top1']:.2f}%, router accuracy "
        f"{100 * moe['router_accuracy']:.2f}% ({moe['images_per_s']:.0f} img/s, {moe['wall_s']:.0f} s)"
    )
    return results
