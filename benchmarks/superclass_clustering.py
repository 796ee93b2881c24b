"""Super-class clustering: time for 1000 classes into 10 super-classes, and recovery (ARI) of planted structure.

    .venv/bin/python benchmarks/superclass_clustering.py [--classes 1000] [--super-classes 10] [--seeds 2] [--quick]

Prints, per method: wall time (median of repeats, after one warm-up) on the 1000-class matrix; then the adjusted Rand
index against the planted groups at several noise levels (share of errors spread uniformly over all classes), with
50 and 10 hard-count images per class and with soft confusion, averaged over seeds; and what balanced clustering
costs in within-super-class confusion. Baseline: random super-classes (ARI ~ 0, chance within-share).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from sklearn.metrics import adjusted_rand_score

from mobile_moe.formats.superclasses import random_super_classes
from mobile_moe.super_class.clustering import cluster
from mobile_moe.super_class.planted import planted_confusion
from mobile_moe.super_class.quality import quality

VARIANTS = [  # (label, method, affinity)
    ("spectral (default: auto)", "spectral", "auto"),
    ("spectral direct", "spectral", "direct"),
    ("spectral shared", "spectral", "shared"),
    ("louvain", "louvain", "auto"),
    ("balanced", "balanced", "auto"),
]


def timing(num_classes: int, num_super_classes: int, repeats: int) -> None:
    planted = planted_confusion(num_classes, num_super_classes, images_per_class=50, noise=0.5, seed=0)
    print(f"time, {num_classes} classes -> {num_super_classes} super-classes (median of {repeats}, after a warm-up)")
    for label, method, affinity in VARIANTS:
        cluster(planted.confusion, num_super_classes, method, 0, affinity)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            cluster(planted.confusion, num_super_classes, method, 0, affinity)
            times.append(time.perf_counter() - start)
        print(f"  {label:26s} {statistics.median(times):6.2f} s   (min {min(times):.2f} s)")


def recovery(num_classes: int, num_super_classes: int, seeds: int, noises: list[float], settings) -> None:
    print(f"\nrecovery (ARI vs planted groups), {num_classes} classes, {num_super_classes} groups, {seeds} seeds")
    for images, soft in settings:
        print(f"  {images} images/class, {'soft' if soft else 'hard counts'}")
        print("    " + f"{'noise':26s}" + "".join(f"{noise:>7.2f}" for noise in noises))
        scores = {label: [] for label, _, _ in VARIANTS}
        scores["random (baseline)"] = []
        for noise in noises:
            runs = [
                planted_confusion(num_classes, num_super_classes, images, noise, soft=soft, seed=seed)
                for seed in range(seeds)
            ]
            for label, method, affinity in VARIANTS:
                aris = [
                    adjusted_rand_score(p.groups, cluster(p.confusion, num_super_classes, method, 0, affinity))
                    for p in runs
                ]
                scores[label].append(np.mean(aris))
            names = [str(c) for c in range(num_classes)]
            aris = [
                adjusted_rand_score(p.groups, random_super_classes(names, num_super_classes, s).assignment)
                for s, p in enumerate(runs)
            ]
            scores["random (baseline)"].append(np.mean(aris))
        for label, values in scores.items():
            print(f"    {label:26s}" + "".join(f"{v:7.2f}" for v in values))


def balance_cost(num_classes: int, num_super_classes: int) -> None:
    print("\ncost of balance: within-super-class share of off-diagonal confusion (planted groups, unequal sizes)")
    for noise in (0.3, 0.5):
        planted = planted_confusion(num_classes, num_super_classes, images_per_class=50, noise=noise, seed=0)
        truth = quality(planted.confusion, planted.groups)
        spectral = quality(planted.confusion, cluster(planted.confusion, num_super_classes, "spectral"))
        balanced = quality(planted.confusion, cluster(planted.confusion, num_super_classes, "balanced"))
        print(
            f"  noise {noise}: planted {truth['within_confusion_share']:.3f} (balance {truth['balance']:.2f}), "
            f"spectral {spectral['within_confusion_share']:.3f} (balance {spectral['balance']:.2f}), "
            f"balanced {balanced['within_confusion_share']:.3f} (balance {balanced['balance']:.2f}), "
            f"chance {balanced['chance_share']:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--super-classes", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer noise levels and settings")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # rows appear as they are measured, also when piped to a file
    print(f"cores visible: {os.cpu_count()}  (timings on a shared machine are noisy)")
    timing(args.classes, args.super_classes, args.repeats)
    noises = [0.2, 0.5, 0.7] if args.quick else [0.1, 0.3, 0.5, 0.6, 0.7]
    settings = [(50, False)] if args.quick else [(50, False), (10, False), (10, True)]
    recovery(args.classes, args.super_classes, args.seeds, noises, settings)
    balance_cost(args.classes, args.super_classes)


if __name__ == "__main__":
    main()
