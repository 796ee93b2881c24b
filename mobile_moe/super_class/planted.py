"""Confusion matrices with planted super-classes, to test and benchmark how well a clustering recovers them.

Shaped like the real case: groups of unequal size; each class confuses with a few members of its group much more than
with others (asymmetric: i -> j need not match j -> i); a share `noise` of every class's errors is spread over all
other classes; a few strong one-way confusions cross groups; and the matrix is sampled from few images per class, so
most entries are 0 or 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Planted:
    confusion: np.ndarray  # (C, C) sampled counts (or soft sums), rows = true class
    groups: np.ndarray  # (C,) planted super-class of each class
    rates: np.ndarray  # (C, C) the expected row-stochastic confusion the counts were sampled from


def planted_sizes(num_classes: int, num_groups: int, rng: np.random.Generator, smallest: int = 2) -> np.ndarray:
    """Unequal group sizes summing to num_classes (Dirichlet proportions; ratios up to ~4x are common)."""
    spare = num_classes - smallest * num_groups
    return smallest + rng.multinomial(spare, rng.dirichlet(np.full(num_groups, 3.0)))


def planted_confusion(
    num_classes: int = 100,
    num_groups: int = 10,
    images_per_class: int = 50,
    noise: float = 0.3,
    accuracy: tuple[float, float] = (0.5, 0.9),
    strong_cross: int | None = None,
    soft: bool = False,
    equal_sizes: bool = False,
    seed: int = 0,
) -> Planted:
    """Sample a confusion matrix whose classes fall into `num_groups` planted groups.

    noise: share of each class's error mass spread uniformly over all other classes (the rest stays in its group).
    strong_cross: number of one-way cross-group pairs that take half of a class's error mass (default C // 20).
    equal_sizes: groups of floor(C/E) or ceil(C/E) classes (for balanced clustering).
    soft: add a softmax-like spread (each image keeps 40% of its class's expected confusion on top of its argmax).
    """
    rng = np.random.default_rng(seed)
    sizes = planted_sizes(num_classes, num_groups, rng, smallest=num_classes // num_groups if equal_sizes else 2)
    groups = rng.permutation(np.repeat(np.arange(num_groups), sizes))  # (C,) so groups are not contiguous
    same_group = groups[:, None] == groups[None, :]
    np.fill_diagonal(same_group, False)

    # Within the group, skewed random weights: a few partners take most of the errors, and i->j != j->i.
    within = np.where(same_group, rng.exponential(1.0, (num_classes, num_classes)) ** 2, 0.0)
    within /= np.maximum(within.sum(1, keepdims=True), 1e-12)
    spread = 1.0 - np.eye(num_classes)
    spread /= spread.sum(1, keepdims=True)
    errors = (1 - noise) * within + noise * spread

    for _ in range(num_classes // 20 if strong_cross is None else strong_cross):
        source = rng.integers(num_classes)
        target = rng.choice(np.flatnonzero(groups != groups[source]))
        errors[source] *= 0.5
        errors[source, target] += 0.5

    error_rate = 1.0 - rng.uniform(*accuracy, size=num_classes)
    rates = errors * error_rate[:, None]
    rates[np.arange(num_classes), np.arange(num_classes)] = 1.0 - error_rate
    counts = np.stack([rng.multinomial(images_per_class, row / row.sum()) for row in rates]).astype(np.float64)
    confusion = 0.6 * counts + 0.4 * images_per_class * rates if soft else counts
    return Planted(confusion, groups, rates)
