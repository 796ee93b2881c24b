"""What the two ways of knowing the expert early cost on real data: scikit-learn's digits, CPU, in one run.

    .venv/bin/python benchmarks/prefetch_options_digits.py [--out DIR] [--seeds 3] [--epochs N]

The model is the tiny scale's ablation backbone (6 blocks of width 64, 32 px digits in 8 px patches, mean pooling)
as a Mobile V-MoE with E=5, k=1, L=2, trained with the super-class router loss (5 super-classes derived from a dense
model of the same backbone, as `make demo` does), --seeds seeds each.

1. Early routing (router_block=J): top-1 and router accuracy on the test split for J from the first MoE block's input
   (4, the default) down to the middle of the trunk (2).
2. Cache-aware routing (margin d), on the default models: top-1 and expert change rate over the test split in order,
   one expert cached (export's Python runtime), and the native runner's p50 with one expert cached on the same
   images (the first seed's bundle), for d = 0, 0.02, 0.05, 0.1, 0.2. d = 0 is plain top-k.
Prints mean +- std over the seeds; writes DIR/summary.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch

from mobile_moe.device_bench.native_runner import run_native
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.export.bundle import export_bundle
from mobile_moe.export.runtime import load_bundle
from mobile_moe.export.source import source_from_run
from mobile_moe.library.build import build_runner
from mobile_moe.models.registry import make_config
from mobile_moe.super_class.demo import derive_for_demo
from mobile_moe.training import recipes
from mobile_moe.training.evaluate import evaluate
from mobile_moe.training.run_dir import load_run
from mobile_moe.training.train import train

BACKBONE = {"patch_size": 8, "image_size": 32, "pool": "mean", "num_classes": 10}
MOE = {"num_experts": 5, "top_k": 1, "moe_layers": 2}
ROUTER_BLOCKS = (None, 3, 2)  # None: after dense block 4, the first MoE block's input
MARGINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 0.8)  # the issue asks for d <= 0.2; a confident router needs more


def trained(out: Path, model: str, seed: int, epochs: int | None, super_classes: str | None = None, **extra) -> Path:
    if (out / "best.pt").exists():
        return out
    config = make_config(model, "6x64", **BACKBONE, **extra)
    recipe = recipes.tiny().replace(device="cpu", seed=seed, **({"epochs": epochs} if epochs else {}))
    return train(config, recipe, "digits", super_classes, out, verbose=False)


def exported(run_dir: Path, out: Path) -> Path:
    if not (out / "manifest.json").exists():
        source = source_from_run(run_dir, calibration=0)
        export_bundle(source.model, out, "executorch", **source.export_kwargs())
    return out


def test_scores(run_dir: Path) -> dict[str, float]:
    run = load_run(run_dir)
    scores = evaluate(run.model, run.open_data().split("test"), run.super_assignment)
    return {"top1": scores["top1"], "router_accuracy": scores["router_accuracy"]}


def cache_aware(bundle: Path, images: torch.Tensor, labels: list[int], margin: float) -> dict[str, float]:
    """Top-1 and expert change rate over the test split in order, one expert cached, with margin `margin`."""
    runtime = load_bundle(bundle, cache_experts=1, cache_margin=margin)
    predictions = [runtime.predict(image) for image in images]
    experts = [p.experts[0] for p in predictions]
    top1 = float(np.mean([int(np.argmax(p.logits)) == label for p, label in zip(predictions, labels, strict=True)]))
    return {"top1": top1, "change_rate": float(np.mean([a != b for a, b in zip(experts, experts[1:], strict=False)]))}


def mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} +- {statistics.stdev(values) if len(values) > 1 else 0.0:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-prefetch-options-digits")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=None, help="default: the tiny recipe's")
    args = parser.parse_args()
    root = Path(args.out)
    dense = trained(root / "dense", "vit", 0, args.epochs)
    super_file = root / "super_classes.json"
    if not super_file.exists():
        derive_for_demo(dense, MOE["num_experts"], super_file, echo=lambda line: None)
    early: dict[str, list[dict]] = {}
    for block in ROUTER_BLOCKS:
        key = "default (4)" if block is None else str(block)
        early[key] = []
        for seed in range(args.seeds):
            extra = {**MOE, **({"router_block": block} if block else {})}
            out = root / f"moe-j{block or 'default'}-seed{seed}"
            early[key].append(test_scores(trained(out, "mobile-vmoe", seed, args.epochs, str(super_file), **extra)))
    print("\n| router reads after block | test top-1 | router accuracy |\n|---|---|---|")
    for key, rows in early.items():
        print(f"| {key} | {mean_std([r['top1'] for r in rows])} | {mean_std([r['router_accuracy'] for r in rows])} |")

    runs = [root / f"moe-jdefault-seed{seed}" for seed in range(args.seeds)]
    bundles = [exported(run, root / "bundles" / run.name) for run in runs]
    test = load_run(runs[0]).open_data().split("test")
    images = torch.stack([test[i][0] for i in range(len(test))])
    labels = [int(test[i][1]) for i in range(len(test))]
    raw = root / "test.f32"
    images.numpy().astype(np.float32).tofile(raw)
    runner = build_runner()
    margins: dict[str, dict] = {}
    print("\n| margin d | test top-1 | expert change rate | native p50 ms, one expert cached |\n|---|---|---|---|")
    for margin in MARGINS:
        rows = [cache_aware(bundle, images, labels, margin) for bundle in bundles]
        settings = RoundSettings(iterations=len(labels), warmup=10, cache_experts=1, cache_margin=margin,
                                 switch_repeats=0)  # fmt: skip
        p50 = run_native(runner, bundles[0], raw, settings)["latency_ms"]["p50"]
        margins[str(margin)] = {"rows": rows, "p50_ms": p50}
        print(f"| {margin} | {mean_std([r['top1'] for r in rows])} | {mean_std([r['change_rate'] for r in rows])} "
              f"| {p50:.3f} |")  # fmt: skip
    (root / "summary.json").write_text(json.dumps({"early_routing": early, "cache_aware": margins}, indent=1))


if __name__ == "__main__":
    main()
