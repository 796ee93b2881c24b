"""What `mobile-moe demo` calls: train the demo's dense ViT or Mobile V-MoE on `digits` on CPU.

from mobile_moe.training.demo import train_digits
dense = train_digits("dense", "demo-out/dense")
moe = train_digits("moe", "demo-out/moe", super_classes="demo-out/super_classes.json")
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from mobile_moe.errors import UsageError
from mobile_moe.models.registry import make_config
from mobile_moe.training import recipes
from mobile_moe.training.evaluate import evaluate
from mobile_moe.training.run_dir import load_run, read_metrics
from mobile_moe.training.train import train

# The demo model: 4 blocks of width 64 (2 heads), 32 px digits in 8 px patches (16 tokens), mean pooling (learns a
# tiny dataset several epochs sooner than a class token). The MoE: E=5 experts, k=1, the last L=2 blocks.
DEMO_MODEL = {"size": "4x64", "patch_size": 8, "image_size": 32, "pool": "mean", "num_classes": 10}
DEMO_MOE = {"num_experts": 5, "top_k": 1, "moe_layers": 2}
MODELS = {"dense": ("vit", {}), "moe": ("mobile-vmoe", DEMO_MOE)}


def train_digits(
    kind: str,
    out_dir: str | os.PathLike,
    super_classes: str | None = None,
    epochs: int | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Train the demo's `kind` ("dense" or "moe") with the tiny recipe on CPU into `out_dir`; evaluate it on the test
    split. `super_classes` (MoE only): a super-class file with 5 super-classes of the digits, or random[:SEED].
    `epochs`: None for the tiny recipe's (15); otherwise at least 1 (0 is refused, not read as "the default").

    Returns run_dir, test_correct (per test image, for paired_difference), test_top1, test_top5, val_top1 (the best
    epoch's: best.pt's), router_accuracy (None for dense), expert_load, images_per_s (mean over epochs) and wall_s.
    """
    name, extra = MODELS[kind]
    fields = dict(DEMO_MODEL)
    config = make_config(name, fields.pop("size"), **fields, **extra)
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise UsageError(f"epochs={epochs!r}: must be an integer of at least 1 (None: the tiny recipe's 15)")
    recipe = recipes.tiny().replace(device="cpu", **({"epochs": epochs} if epochs is not None else {}))
    start = time.perf_counter()
    run_dir = train(config, recipe, "digits", super_classes, Path(out_dir), verbose=verbose)
    wall = time.perf_counter() - start
    run = load_run(run_dir)
    test = run.open_data().split("test")
    scores = evaluate(run.model, test, run.super_assignment)
    rows = read_metrics(run_dir)
    return {
        "run_dir": str(run_dir),
        "test_correct": correct_per_image(run.model, test),
        "epochs": recipe.epochs,
        "test_top1": scores["top1"],
        "test_top5": scores["top5"],
        "val_top1": max(row["val_top1"] for row in rows),  # best.pt's: what export records and bench plots
        "router_accuracy": scores["router_accuracy"],
        "expert_load": scores.get("expert_load"),
        "images_per_s": sum(r["images_per_s"] for r in rows) / len(rows),
        "wall_s": wall,
    }


def correct_per_image(model, dataset) -> list[bool]:
    """Whether the model's top-1 is right, image by image, on the CPU: two models' lists on one split pair up."""
    import torch

    images = torch.stack([image for image, _ in dataset])
    labels = torch.tensor([label for _, label in dataset])
    with torch.no_grad():
        return (model.eval()(images).logits.argmax(-1) == labels).tolist()


def paired_difference(first: list[bool], second: list[bool]) -> tuple[float, float]:
    """(mean of second - first, half-width of its 95% interval) over the same images, image by image: the test
    split's sampling noise on the difference (a normal approximation; run-to-run training noise comes on top)."""
    import statistics

    differences = [int(b) - int(a) for a, b in zip(first, second, strict=True)]
    spread = statistics.stdev(differences) if len(differences) > 1 else 0.0
    return statistics.fmean(differences), 1.96 * spread / len(differences) ** 0.5
