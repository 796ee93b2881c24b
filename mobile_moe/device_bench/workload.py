"""The images a benchmark feeds a bundle: real ones from a data spec (so the expert sequence is real) or random.

Either way they are written once as a raw float32 file (N x C x S x S, already normalised with the bundle's own
mean/std) that every runner reads, so all runtimes and devices see exactly the same inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mobile_moe.data.datasets import open_data
from mobile_moe.errors import UsageError
from mobile_moe.export.manifest_schema import Manifest
from mobile_moe.utils.class_names import check_classes
from mobile_moe.utils.devices import memory_limit, over_memory_limit


@dataclass
class Workload:
    images: np.ndarray  # (N, C, S, S) float32, normalised
    source: str  # "random:SEED" or the data spec and split


def random_workload(shape: list[int], count: int, seed: int = 0) -> Workload:
    """Standard-normal images: already "normalised", as if mean/std had been applied."""
    generator = np.random.default_rng(seed)
    images = generator.standard_normal((count, *shape[1:]), dtype=np.float32)
    return Workload(images, f"random:{seed}")


# How a data workload draws its images from the val split (--order). A real folder's val split is sorted by class, so
# its first N images are one or two classes that all route to one expert: a bench on them never sees a switch.
ORDERS = {
    "stratified": "every class in turn as far as the count allows, then shuffled (seeded)",
    "shuffled": "a seeded random sample of the split, in random order",
    "folder": "the split's first images, in folder (class) order",
}


def draw_indices(labels: list[int], count: int, order: str, seed: int) -> np.ndarray:
    """`count` indices into a split with these `labels`, drawn by `order` (ORDERS) with `seed`."""
    if order not in ORDERS:
        raise UsageError(f"--order {order}: choose one of {', '.join(ORDERS)}")
    count = min(count, len(labels))
    if order == "folder":
        return np.arange(count)
    generator = np.random.default_rng(seed)
    if order == "shuffled":
        return generator.permutation(len(labels))[:count]
    by_class = [generator.permutation(np.flatnonzero(np.asarray(labels) == c)) for c in sorted(set(labels))]
    # Round-robin over the classes (each class's images in random order), so `count` holds every class equally as far
    # as the split allows; then one shuffle, so consecutive images are as independent as real use's.
    dealt = [members[i] for i in range(max(map(len, by_class))) for members in by_class if i < len(members)]
    return generator.permutation(np.array(dealt[:count]))


def data_workload(
    spec: str, manifest: Manifest, count: int, *, bundle: str | Path, order: str = "stratified", seed: int = 0
) -> Workload:
    """`count` images of the spec's val split drawn by `order` (ORDERS) with `seed`, preprocessed with the bundle's
    recorded normalisation; the spec must have the classes of the bundle (its directory: `bundle`)."""
    data = open_data(spec, manifest.input.shape[-1], mean=manifest.input.mean, std=manifest.input.std)
    fix = "bench on data with the bundle's classes (their routing is the one it learnt), or on --data random"
    check_classes(manifest.class_names, data, whose=f"bundle {bundle}", fix=fix)
    split = data.split("val")
    indices = draw_indices(data.targets("val"), count, order, seed)
    images = np.stack([split[int(i)][0].numpy() for i in indices]).astype(np.float32)
    described = "first" if order == "folder" else f"{order}, seed {seed},"
    return Workload(images, f"{spec} (val, {described} {len(indices)} of {len(split)})")


def check_fits_memory(count: int, shape: list[int]) -> None:
    """UsageError unless `count` float32 images of `shape` (1, C, S, S) fit in the memory one argument may ask for
    (mobile_moe.utils.devices.memory_limit: the workload is held in memory, then written once to a raw file that every
    runner reads beside its own model and buffers): a count typed with zeros too many is refused in one line."""
    image_bytes = 4 * math.prod(shape[1:])
    excess = over_memory_limit(count * image_bytes)
    if excess is not None:
        raise UsageError(
            f"--images {count}: {'x'.join(map(str, shape[1:]))} images of {excess}; give at most "
            f"{max(1, memory_limit() // image_bytes)}"
        )


def random_seed(spec: str) -> int | None:
    """The seed of a `random` / `random:SEED` spec (0 when omitted); None for a data spec, which mobile_moe.data checks
    when it opens it."""
    if spec != "random" and not spec.startswith("random:"):
        return None
    seed = spec.partition(":")[2] or "0"
    if not seed.isdigit():
        raise UsageError(f"--data {spec}: the seed must be a non-negative integer, e.g. random:3")
    return int(seed)


def make_workload(
    spec: str, manifest: Manifest, count: int, *, bundle: str | Path, order: str = "stratified", seed: int = 0
) -> Workload:
    """`random` / `random:SEED`, or any data spec mobile_moe.data understands (with the classes of `bundle`, the
    directory `manifest` came from), its val images drawn by `order` with `seed` (data_workload)."""
    if count < 1:
        raise UsageError(f"--images {count}: must be at least 1")
    check_fits_memory(count, manifest.input.shape)  # before numpy is asked for it
    random_images_seed = random_seed(spec)
    if random_images_seed is not None:
        return random_workload(manifest.input.shape, count, random_images_seed)
    return data_workload(spec, manifest, count, bundle=bundle, order=order, seed=seed)


def write_raw(workload: Workload, path: Path) -> Path:
    np.ascontiguousarray(workload.images, dtype=np.float32).tofile(path)
    return path
