"""The confusion graph: one node per class, edges weighted by how often two classes are mistaken for each other.

`class_affinity` is the paper's graph as a matrix (symmetrised, row-normalised, off-diagonal confusion).
`clustering_affinity` prepares it for clustering when the confusion is sparse and noisy (1000 classes, a few
validation images each). Measured on planted structure (benchmarks/superclass_clustering.py): a small constant on
every pair (regularised spectral clustering, Amini et al. 2013) keeps classes that nobody confuses from breaking off
into super-classes of their own, while a large one (tau ~ mean degree) washes the signal out; kNN sparsification gave
no gain for spectral clustering but keeps the graph small for Louvain; the second-order "shared" affinity (cosine of
confusion profiles) is the one densification that helps, when errors are spread thinly over many classes.
"""

from __future__ import annotations

import numpy as np


def class_affinity(confusion: np.ndarray) -> np.ndarray:
    """(C, C) symmetric affinity: 0.5 (P + P^T) with P[i, j] = confusion[i, j] / row_sum[i], diagonal zero.

    A class without images (zero row) keeps a zero row in P, so its edges come from its column only: how often other
    classes are predicted as it.
    """
    row_sums = confusion.sum(1, keepdims=True)
    rates = np.divide(confusion, row_sums, out=np.zeros_like(confusion), where=row_sums > 0)
    np.fill_diagonal(rates, 0.0)
    return 0.5 * (rates + rates.T)


def default_neighbours(num_classes: int) -> int:
    """Strong confusions kept per class: ~sqrt(C), at least 5 (1000 classes -> 32; 10 classes -> all)."""
    return int(min(num_classes - 1, max(5, round(np.sqrt(num_classes)))))


def knn_sparsify(affinity: np.ndarray, neighbours: int) -> np.ndarray:
    """Keep affinity[i, j] if j is among i's `neighbours` strongest partners or i among j's (symmetric union)."""
    num_classes = affinity.shape[0]
    if neighbours >= num_classes - 1:
        return affinity.copy()
    strongest = np.argpartition(-affinity, neighbours, axis=1)[:, :neighbours]  # (C, k) column indices
    keep = np.zeros_like(affinity, dtype=bool)
    keep[np.arange(num_classes)[:, None], strongest] = True
    keep &= affinity > 0
    keep |= keep.T
    return np.where(keep, affinity, 0.0)


def regularise(affinity: np.ndarray, strength: float) -> np.ndarray:
    """Add `strength` x (mean degree / C) to every off-diagonal pair: connects the graph, damps low-degree nodes."""
    num_classes = affinity.shape[0]
    mean_degree = affinity.sum() / num_classes
    result = affinity + strength * mean_degree / num_classes
    np.fill_diagonal(result, 0.0)
    return result


def shared_confusion(affinity: np.ndarray) -> np.ndarray:
    """Second-order affinity: cosine similarity of two classes' confusion profiles (whom they are confused with).

    Dense even where direct confusions are sampled thinly, and it averages uniform noise out over many partners; on
    planted 1000-class structure with 50 hard-count images per class it recovers the groups at noise levels where the
    direct graph fails (benchmarks/superclass_clustering.py), but costs a little at low noise and with few images.
    """
    unit_rows = affinity / np.maximum(np.linalg.norm(affinity, axis=1, keepdims=True), 1e-12)  # (C, C)
    shared = unit_rows @ unit_rows.T
    np.fill_diagonal(shared, 0.0)
    return shared


AFFINITIES = ("direct", "shared")


def clustering_affinity(
    confusion: np.ndarray, kind: str = "direct", neighbours: int | None = None, regularisation: float = 0.05
) -> np.ndarray:
    """The affinity the clustering methods see.

    kind: "direct" (the paper's confusion graph) or "shared" (`shared_confusion` of it). neighbours: keep only each
    class's strongest partners (kNN; None keeps all). regularisation: `regularise` strength; the default 0.05 is small
    enough to cost nothing measurable on planted structure and still ties classes nobody confuses into the graph.
    """
    affinity = class_affinity(confusion)
    if kind == "shared":
        affinity = shared_confusion(affinity)
    elif kind != "direct":
        raise ValueError(f"affinity {kind!r}: choose one of {AFFINITIES}")
    if neighbours is not None:
        affinity = knn_sparsify(affinity, neighbours)
    if regularisation > 0:
        affinity = regularise(affinity, regularisation)
    return affinity
