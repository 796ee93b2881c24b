"""How good a super-class division is: how much of the confusion it keeps inside super-classes, and how even it is."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from mobile_moe.super_class.graph import class_affinity


def within_share(matrix: np.ndarray, assignment: np.ndarray) -> float | None:
    """Share of the off-diagonal mass of `matrix` that falls between classes of the same super-class.

    None where it is undefined: no off-diagonal mass at all (or a mass too large to sum in float64).
    """
    off_diagonal = matrix - np.diag(np.diag(matrix))
    return _share_of(off_diagonal, off_diagonal.sum(), assignment)


def _share_of(off_diagonal: np.ndarray, total: float, assignment: np.ndarray) -> float | None:
    """within_share from the off-diagonal matrix and its sum, which a caller scoring many assignments computes once."""
    if not (np.isfinite(total) and total > 0):
        return None
    same = assignment[:, None] == assignment[None, :]
    share = float(off_diagonal[same].sum() / total)
    return min(max(share, 0.0), 1.0) if np.isfinite(share) else None


def random_share(sizes: np.ndarray) -> float | None:
    """Expected within share if confusion fell on uniformly random pairs of distinct classes (the chance level);
    None for fewer than 2 classes (no pairs)."""
    num_classes = int(sizes.sum())
    if num_classes < 2:
        return None
    return float((sizes * (sizes - 1)).sum() / (num_classes * (num_classes - 1)))


CHANCE_SAMPLES = 200  # random groupings drawn to measure how far chance alone moves the within share


def chance_spread(matrix: np.ndarray, assignment: np.ndarray, seed: int = 0) -> float | None:
    """The within share's standard deviation over random super-classes of the same sizes (the assignment shuffled,
    CHANCE_SAMPLES times, seeded): how far a grouping can stray from `chance_share` by luck alone, so a derived
    grouping's distance from chance can be read in units of it. None where the share is undefined."""
    off_diagonal = matrix - np.diag(np.diag(matrix))
    total = off_diagonal.sum()
    if _share_of(off_diagonal, total, assignment) is None:
        return None
    rng = np.random.default_rng(seed)
    shares = [_share_of(off_diagonal, total, rng.permutation(assignment)) for _ in range(CHANCE_SAMPLES)]
    return float(np.std(shares))


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def quality(confusion: np.ndarray, assignment, classes_without_images: list[int] | None = None) -> dict[str, Any]:
    """The `quality` block of a super-class file.

    confusion_mass: the off-diagonal mass itself, in images (misclassified images for hard counts, summed
    probability of the wrong classes for soft ones): the evidence the grouping rests on.
    within_confusion_share: off-diagonal confusion mass inside super-classes (raw matrix, so frequent classes count
    more); within_affinity_share: the same on the row-normalised graph (every class counts equally); chance_share:
    what random super-classes of the same sizes would get, and chance_share_std how much that varies from one random
    grouping to another (on this matrix); balance: smallest / largest size. A share that is
    undefined (no off-diagonal confusion to share out) is None (null in the file), never NaN.
    """
    assignment = np.asarray(assignment)
    sizes = np.bincount(assignment)
    off_diagonal = np.asarray(confusion, dtype=np.float64)
    return {
        "confusion_mass": _rounded(float(off_diagonal.sum() - np.trace(off_diagonal))),
        "within_confusion_share": _rounded(within_share(confusion, assignment)),
        "within_affinity_share": _rounded(within_share(class_affinity(confusion), assignment)),
        "chance_share": _rounded(random_share(sizes)),
        "chance_share_std": _rounded(chance_spread(confusion, assignment)),
        "sizes": sizes.tolist(),
        "size_min": int(sizes.min()),
        "size_max": int(sizes.max()),
        "balance": round(float(sizes.min() / sizes.max()), 6),
        "classes_without_images": list(classes_without_images or []),
    }


def bootstrap_confusion(confusion: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One bootstrap resample of the images behind `confusion`: each class's row redrawn as round(row sum) images
    from its own row's distribution (multinomially). For hard counts that is resampling each class's validation
    images; for soft sums it treats each image's probability mass as whole images, a little noisier than the data."""
    resampled = np.zeros_like(confusion, dtype=np.float64)
    for row, counts in enumerate(np.asarray(confusion, dtype=np.float64)):
        total = counts.sum()
        if total > 0:
            resampled[row] = rng.multinomial(max(1, round(total)), counts / total)
    return resampled


def stability(confusion: np.ndarray, assignment, cluster, resamples: int, seed: int = 0) -> dict[str, Any]:
    """How far the grouping holds on other draws of the validation images: the adjusted Rand index between
    `assignment` and `cluster(resampled matrix, seed)` over `resamples` bootstrap resamples (each its own clustering
    seed). 1: the same grouping every time; about 0: no more alike than chance."""
    from sklearn.metrics import adjusted_rand_score

    rng = np.random.default_rng(seed)
    with warnings.catch_warnings():  # a resample of a sparse matrix can split its graph; the score says so itself
        warnings.filterwarnings("ignore", message="Graph is not fully connected", category=UserWarning)
        scores = [adjusted_rand_score(assignment, cluster(bootstrap_confusion(confusion, rng), seed + 1 + i))
                  for i in range(resamples)]  # fmt: skip
    return {"resamples": resamples, "mean_ari": _rounded(float(np.mean(scores))),
            "min_ari": _rounded(float(np.min(scores))), "max_ari": _rounded(float(np.max(scores)))}  # fmt: skip
