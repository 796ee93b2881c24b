"""`synthetic[:classes=C,super=S,per_class=N,noise=X,seed=K]`: procedural images with a planted class hierarchy.

Every super-class owns a coloured grating (its orientation, frequency and colour); each class of that super-class adds
a small blob at its own position and colour on top. Classes of one super-class therefore share most of their pixels
and a dense model confuses them with each other far more than with the rest: the structure the paper's super-class
router is meant to exploit, with the true super-classes known. Deterministic in (spec, image size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mobile_moe.data.spec_options import EXAMPLES, parse_options
from mobile_moe.errors import UsageError
from mobile_moe.utils.devices import over_memory_limit


@dataclass(frozen=True)
class SyntheticSpec:
    classes: int = 12
    super: int = 4  # super-classes; class c belongs to super-class c * super // classes (contiguous blocks)
    per_class: int = 100  # images per class, before the train/val/test split
    noise: float = 0.1  # std of the per-pixel Gaussian noise, images in [0, 1]
    seed: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.super <= self.classes:
            raise UsageError(f"synthetic: super={self.super} must be between 2 and classes={self.classes}")
        if self.per_class < 10:
            raise UsageError(f"synthetic: per_class={self.per_class} is too few to split; use at least 10")
        if self.noise < 0:
            raise UsageError(f"synthetic: noise={self.noise} must be >= 0")

    @property
    def assignment(self) -> list[int]:
        return [c * self.super // self.classes for c in range(self.classes)]


def parse_synthetic(argument: str) -> SyntheticSpec:
    """ "classes=12,super=4" -> SyntheticSpec; every key type-checked against the dataclass field."""
    return parse_options(SyntheticSpec, argument, "synthetic", EXAMPLES["synthetic"])


WORKING_BYTES_PER_PIXEL = 80  # generate's float64 arrays at their peak: two (N, 3, S, S) and four (N, S, S)


def _check_generation_fits(spec: SyntheticSpec, image_size: int) -> None:
    """UsageError unless generating the set fits the memory one input may ask for
    (mobile_moe.utils.devices.memory_limit)."""
    excess = over_memory_limit(WORKING_BYTES_PER_PIXEL * spec.classes * spec.per_class * image_size**2)
    if excess is not None:
        raise UsageError(
            f"synthetic: classes={spec.classes} x per_class={spec.per_class} images of {image_size} px need about "
            f"{excess} to generate; ask for fewer classes or images per class, e.g. --data {EXAMPLES['synthetic']}"
        )


def generate(spec: SyntheticSpec, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """-> images uint8 (N, 3, S, S), labels int64 (N,), N = classes * per_class, ordered by class."""
    _check_generation_fits(spec, image_size)
    rng = np.random.default_rng(spec.seed)
    S, C = image_size, spec.classes
    # Structure shared by a super-class: grating orientation, frequency (cycles per image) and colour.
    theta = np.pi * (np.arange(spec.super) + rng.uniform(-0.15, 0.15, spec.super)) / spec.super  # (S_sup,)
    freq = rng.uniform(2.0, 4.0, spec.super)
    base_phase = rng.uniform(0, 2 * np.pi, spec.super)
    grating_colour = rng.uniform(0.2, 1.0, (spec.super, 3))
    # What sets a class apart inside its super-class: a blob's position and colour.
    blob_centre = rng.uniform(0.25, 0.75, (C, 2))
    blob_colour = rng.uniform(0.0, 1.0, (C, 3))

    labels = np.repeat(np.arange(C), spec.per_class)  # (N,)
    supers = np.asarray(spec.assignment)[labels]  # (N,)
    n = len(labels)
    y, x = np.meshgrid(np.linspace(0, 1, S), np.linspace(0, 1, S), indexing="ij")  # (S, S) each
    # Per-image nuisance: grating phase jitter, blob jitter and size, pixel noise.
    phase = base_phase[supers] + rng.normal(0, 0.4, n)
    centre = blob_centre[labels] + rng.normal(0, 0.04, (n, 2))  # (N, 2)
    radius = rng.uniform(0.08, 0.12, n)

    along = x[None] * np.cos(theta[supers])[:, None, None] + y[None] * np.sin(theta[supers])[:, None, None]
    grating = np.sin(2 * np.pi * freq[supers][:, None, None] * along + phase[:, None, None])  # (N, S, S)
    dist2 = (x[None] - centre[:, 0, None, None]) ** 2 + (y[None] - centre[:, 1, None, None]) ** 2
    blob = np.exp(-dist2 / (2 * radius[:, None, None] ** 2))  # (N, S, S)

    images = 0.5 + 0.3 * grating[:, None] * grating_colour[supers][:, :, None, None]  # (N, 3, S, S)
    images += 0.6 * blob[:, None] * (blob_colour[labels][:, :, None, None] - 0.5)
    images += rng.normal(0, spec.noise, images.shape)
    return (np.clip(images, 0, 1) * 255).round().astype(np.uint8), labels.astype(np.int64)


def class_names(spec: SyntheticSpec) -> list[str]:
    return [f"s{s}c{c}" for c, s in enumerate(spec.assignment)]


def super_class_names(spec: SyntheticSpec) -> list[str]:
    return [f"s{s}" for s in range(spec.super)]
