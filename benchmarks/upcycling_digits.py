"""Sparse upcycling on digits: does a Mobile V-MoE started from a trained dense run (`train --init-from`) reach the
from-scratch MoE's accuracy in fewer epochs?

    .venv/bin/python benchmarks/upcycling_digits.py [--out DIR] [--epochs N] [--seeds S]

Trains the demo's dense ViT (4x64, patch 8, 32 px, mean pooling; tiny recipe), derives E=5 super-classes from its
validation confusions (the paper's recipe), then Mobile V-MoEs (E=5, k=1, L=2) with those super-classes, the same
recipe and seed: one from scratch, one upcycled from the dense run (its best.pt). Prints both validation top-1 curves
epoch by epoch, and for each seed the first epoch at which the upcycled run reaches the from-scratch run's best.
CPU only, no timing: the numbers do not depend on the host's load.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mobile_moe.models.registry import make_config
from mobile_moe.training import recipes
from mobile_moe.training.demo import DEMO_MODEL, DEMO_MOE
from mobile_moe.training.run_dir import holds_results, read_metrics
from mobile_moe.training.train import resume_training, train


def model_config(name: str, **extra):
    fields = dict(DEMO_MODEL)
    return make_config(name, fields.pop("size"), **fields, **extra)


def derive_super_classes(dense_dir: Path, out: Path) -> Path:
    from mobile_moe.super_class.derive import derive_super_classes
    from mobile_moe.training.evaluate import confusion_from_run

    confusion = confusion_from_run(dense_dir, device="cpu")
    derived = derive_super_classes(confusion.matrix, DEMO_MOE["num_experts"], class_names=confusion.class_names)
    derived.save(out)
    return out


def curve(run_dir: Path) -> list[float]:
    return [row["val_top1"] for row in read_metrics(run_dir)]


def first_epoch_reaching(values: list[float], target: float) -> int | None:
    return next((epoch for epoch, value in enumerate(values, 1) if value >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/upcycling-digits"))
    parser.add_argument("--epochs", type=int, default=15, help="epochs of every run (the tiny recipe's 15)")
    parser.add_argument("--seeds", type=int, default=1, help="MoE seeds (the dense run and super-classes are shared)")
    args = parser.parse_args()

    recipe = recipes.tiny().replace(device="cpu", epochs=args.epochs)
    dense_dir = args.out / "dense"
    if not holds_results(dense_dir):
        train(model_config("vit"), recipe, "digits", None, dense_dir, verbose=False)
    supers = derive_super_classes(dense_dir, args.out / "super_classes.json")
    print(f"dense vit: val top-1 by epoch {fmt(curve(dense_dir))}")
    for seed in range(args.seeds):
        seeded = recipe.replace(seed=seed)
        curves = {}
        for kind, init_from in (("scratch", None), ("upcycled", dense_dir)):
            out = args.out / f"moe-{kind}-seed{seed}"
            if not holds_results(out):
                train(model_config("mobile-vmoe", **DEMO_MOE), seeded, "digits", str(supers), out, verbose=False,
                      init_from=init_from)  # fmt: skip
            elif len(read_metrics(out)) < args.epochs:  # a run from an earlier, shorter invocation: extend it
                resume_training(out, verbose=False, epochs=args.epochs)
            curves[kind] = curve(out)[: args.epochs]
            print(f"seed {seed} {kind:>8}: val top-1 by epoch {fmt(curves[kind])}")
        target = max(curves["scratch"])
        reached = first_epoch_reaching(curves["upcycled"], target)
        scratch_epoch = first_epoch_reaching(curves["scratch"], target)
        print(
            f"seed {seed}: from scratch, best {100 * target:.2f}% at epoch {scratch_epoch}; upcycled reaches it at "
            f"epoch {reached if reached is not None else 'never'} (best {100 * max(curves['upcycled']):.2f}%)"
        )


def fmt(values: list[float]) -> str:
    return " ".join(f"{100 * v:.1f}" for v in values)


if __name__ == "__main__":
    main()
