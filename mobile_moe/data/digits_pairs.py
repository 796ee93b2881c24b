"""`digits-pairs[:train=N,val=M,test=K,seed=S]`: two real handwritten digits side by side, 100 classes, offline.

Each image is two of scikit-learn's 8x8 digits next to each other on a 16x16 canvas (each digit's aspect kept), its
class the two-digit number ("00".."99"). The 1,797 source digits are split first (70 / 15 / 15 %, stratified, the
data splits' fixed seed), so no digit image appears in two splits; the pairs are then drawn from each split's own
digits, deterministically from `seed`: the classes in turn (balanced to within one image), each side a random digit
of its class. The coarse super-classes are the tens digit (10 groups of 10, like CIFAR-100's coarse labels).

Default sizes: 6,000 training pairs (60 per class) train the tiny scale's models in about a minute per run on 2 CPU
cores, and leave them far from saturation; 1,000 validation pairs pick checkpoints and derive super-classes; 4,000
test pairs (40 per class) keep the test accuracy's sampling error near half a point, below the seed-to-seed spread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mobile_moe.data.spec_options import parse_options
from mobile_moe.errors import UsageError

NUM_CLASSES = 100
CANVAS = 16  # two 8x8 digits side by side, centred vertically


@dataclass(frozen=True)
class DigitsPairsSpec:
    train: int = 6000
    val: int = 1000
    test: int = 4000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("train", "val", "test"):
            size = getattr(self, name)
            if not NUM_CLASSES <= size <= 1_000_000:
                raise UsageError(
                    f"digits-pairs: {name}={size} must be between {NUM_CLASSES} (one pair per class) and 1000000"
                )

    def sizes(self) -> dict[str, int]:
        return {"train": self.train, "val": self.val, "test": self.test}


def parse_digits_pairs(argument: str) -> DigitsPairsSpec:
    return parse_options(DigitsPairsSpec, argument, "digits-pairs", "digits-pairs:train=6000,test=4000")


def class_names() -> list[str]:
    return [f"{c:02d}" for c in range(NUM_CLASSES)]


def coarse_assignment() -> list[int]:
    """Class -> its tens digit: the coarse super-classes."""
    return [c // 10 for c in range(NUM_CLASSES)]


def coarse_names() -> list[str]:
    return [f"{tens}x" for tens in range(10)]


def pair_images(digits: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """digits (N, 8, 8) in 0..16 -> (len(left), CANVAS, CANVAS) float in 0..16: digits[left] | digits[right]."""
    canvas = np.zeros((len(left), CANVAS, CANVAS), dtype=np.float32)
    top = (CANVAS - 8) // 2
    canvas[:, top : top + 8, :8] = digits[left]
    canvas[:, top : top + 8, 8:] = digits[right]
    return canvas


def draw_pairs(digit_labels: np.ndarray, count: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """`count` pairs of indices into one split's digits, the classes balanced: -> (left, right, labels)."""
    labels = rng.permutation(np.arange(count) % NUM_CLASSES)
    sides = []
    for side_digit in (labels // 10, labels % 10):  # tens on the left, units on the right
        side = np.empty(count, dtype=np.int64)
        for digit in range(10):
            wanted = side_digit == digit
            candidates = np.flatnonzero(digit_labels == digit)
            side[wanted] = candidates[rng.integers(0, len(candidates), wanted.sum())]
        sides.append(side)
    return sides[0], sides[1], labels.astype(np.int64)


def generate(
    spec: DigitsPairsSpec, source: dict[str, tuple[np.ndarray, np.ndarray]]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """source: {split: (its 8x8 digits (n, 8, 8) in 0..16, their labels)}, already split (mobile_moe/data/datasets.py)
    -> {split: (pair canvases (N, CANVAS, CANVAS) in 0..16, labels int64 (N,))}: each split's pairs made of its own
    digits only. data.py resizes them as it resizes `digits`."""
    rng = np.random.default_rng(spec.seed)
    splits = {}
    for name, (digits, digit_labels) in source.items():
        left, right, labels = draw_pairs(digit_labels, spec.sizes()[name], rng)
        splits[name] = (pair_images(digits, left, right), labels)
    return splits
