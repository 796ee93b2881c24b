"""How good a super-class division is: how much of the confusion it keeps inside super-classes, and how even it is."""

from __future__ import annotations

from typing import Any

import numpy as np

from super_class.graph import class_affinity


def within_share(matrix: np.ndarray, assignment: np.ndarray) -> float:
    """Share of the off-diagonal mass of `matrix` that falls between classes of the same super-class."""
    off_diagonal = matrix - np.diag(np.diag(matrix))
    same = assignment[:, None] == assignment[None, :]
    total = off_diagonal.sum()
    return float(off_diagonal[same].sum() / total) if total > 0 else 0.0


def random_share(sizes: np.ndarray) -> float:
    """Expected within share if confusion fell on uniformly random pairs of distinct classes (the chance level)."""
    num_classes = sizes.sum()
    return float((sizes * (sizes - 1)).sum() / (num_classes * (num_classes - 1)))


def quality(confusion: np.ndarray, assignment, classes_without_images: list[int] | None = None) -> dict[str, Any]:
    """The `quality` block of a super-class file.

    within_confusion_share: off-diagonal confusion mass inside super-classes (raw matrix, so frequent classes count
    more); within_affinity_share: the same on the row-normalised graph (every class counts equally); chance_share:
    what random super-classes of the same sizes would get; balance: smallest / largest size.
    """
    assignment = np.asarray(assignment)
    sizes = np.bincount(assignment)
    return {
        "within_confusion_share": round(within_share(confusion, assignment), 6),
        "within_affinity_share": round(within_share(class_affinity(confusion), assignment), 6),
        "chance_share": round(random_share(sizes), 6),
        "sizes": sizes.tolist(),
        "size_min": int(sizes.min()),
        "size_max": int(sizes.max()),
        "balance": round(float(sizes.min() / sizes.max()), 6),
        "classes_without_images": list(classes_without_images or []),
    }
