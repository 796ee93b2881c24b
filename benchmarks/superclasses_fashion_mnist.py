"""Does the confusion graph find Fashion-MNIST's semantic groups by itself? Super-classes for E = 2..5 from a dense ViT.

    .venv/bin/python benchmarks/superclasses_fashion_mnist.py [--out DIR] [--data SPEC] [--epochs N] [--device D]

Trains a dense ViT (the tiny scale's ablation backbone: 6x64, patch 8, 32 px, mean pooling; tiny recipe, batch 128)
on `--data` (default: all of Debian's Fashion-MNIST), derives E = 2..5 super-classes from its soft validation
confusions (the paper's recipe, `superclass derive`'s defaults), and prints for each E: the groups with their class
names, their adjusted Rand index against the coarse grouping (tops, footwear, trouser, dress, bag), whether footwear
stayed in one super-class and whether any super-class mixes tops with footwear, bags or trousers; then the Table-1
listing. No timing: the numbers do not depend on the host's load (the wall time is printed for the record).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from sklearn.metrics import adjusted_rand_score

from mobile_moe.data.datasets import open_data
from mobile_moe.evidence.scales import SCALES
from mobile_moe.models.registry import make_config
from mobile_moe.super_class.derive import derive_super_classes
from mobile_moe.super_class.table import format_table
from mobile_moe.training import recipes
from mobile_moe.training.evaluate import confusion_from_run
from mobile_moe.training.run_dir import holds_results, read_metrics
from mobile_moe.training.train import train

EXPERTS = (2, 3, 4, 5)
UPPER_BODY = "tops"
NOT_WITH_TOPS = ("footwear", "bag", "trouser")


def dense_run(out: Path, data: str, epochs: int, device: str) -> Path:
    tiny = SCALES["tiny"]
    run = out / "dense"
    if not holds_results(run):
        config = make_config("vit", f"{tiny.ablation.depth}x{tiny.ablation.width}", patch_size=tiny.ablation.patch_size,
                             num_heads=tiny.ablation.num_heads, image_size=tiny.image_size, pool=tiny.pool,
                             num_classes=10)  # fmt: skip
        recipe = recipes.tiny().replace(device=device, epochs=epochs, batch_size=128)
        train(config, recipe, data, None, run, verbose=True)
    return run


def judged(assignment: list[int], coarse: list[int], coarse_names: list[str]) -> str:
    """Footwear whole, and no super-class holding a top together with footwear, a bag or a trouser."""
    group_of = {name: [c for c, g in enumerate(coarse) if coarse_names[g] == name] for name in coarse_names}
    footwear_whole = len({assignment[c] for c in group_of["footwear"]}) == 1
    mixed = any(
        {assignment[c] for c in group_of[UPPER_BODY]} & {assignment[c] for c in group_of[other]}
        for other in NOT_WITH_TOPS
    )
    others = "/".join(NOT_WITH_TOPS)
    return f"footwear whole: {'yes' if footwear_whole else 'no'}; tops mixed with {others}: {'yes' if mixed else 'no'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/superclasses-fashion-mnist"))
    parser.add_argument("--data", default="fashion-mnist")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    started = time.perf_counter()
    run = dense_run(args.out, args.data, args.epochs, args.device)
    coarse = open_data(args.data, SCALES["tiny"].image_size).super_classes
    confusion = confusion_from_run(run, split="val", device=args.device)
    best = max(row["val_top1"] for row in read_metrics(run))
    print(f"dense 6x64/8 on {args.data}: {args.epochs} epochs, best val top-1 {100 * best:.2f}%")
    for experts in EXPERTS:
        derived = derive_super_classes(confusion.matrix, experts, class_names=confusion.class_names,
                                       source=f"{run} (val, soft)")  # fmt: skip
        ari = adjusted_rand_score(coarse.assignment, derived.assignment)
        groups = [", ".join(derived.class_names[c] for c in derived.members(s)) for s in range(experts)]
        print(f"\nE={experts}: ARI vs coarse {ari:.2f}; {judged(derived.assignment, coarse.assignment, coarse.names)}")
        print("  " + " | ".join("{" + group + "}" for group in groups))
        print(format_table(derived, examples=4))
    print(f"\nwall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
