"""The training augmentation of augment.py (the deit recipe's), on a whole uint8 batch on the training device, each
image with its own draws: the input path of `train --input-pipeline device`.

    draws = draw(aug, sizes, image_size=S, key=StepKey(seed, epoch, rank, step))   # numpy, on the host
    to_model = BatchAugment(image_size=S, mean=mean, std=std, num_classes=C, device=device)
    images, targets = to_model.apply(canvas, sizes, draws, labels)   # on the device, nothing read back

`draw` makes every random choice of one step on the host, from a numpy generator keyed by (seed, epoch, rank, step):
the same batches whatever --workers is, on CPU and CUDA alike, and a resumed run replays them. `apply` then runs on
whatever device `canvas` is on, with no host sync: the images of a batch, padded into one canvas (B, 3, H, W), go
through ONE resample each (RandomResizedCrop, flip and RandAugment's shears, translations and rotations composed into
one inverse affine map, sampled bilinearly with supersampling for antialias), RandAugment's colour operations grouped
by (operation, sign) and run through torchvision's own kernels on each group, normalisation, random erasing, and
MixUp or CutMix.

Where the distributions differ from torchvision's per-image pipeline (docs/formats.md "Batched augmentation" says by
how much): the crop, flip, erasing and mixing draws follow the same laws exactly; RandAugment picks the same ops with
the same magnitudes and signs, but its geometric ops act before its colour ops (torchvision applies the two in the
order drawn) and resample once, bilinearly, where torchvision resamples each nearest-neighbour; images stay float
between operations (torchvision's uint8 path rounds after each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mobile_moe.data.augment import Augmentation

CROP_RATIO = (3 / 4, 4 / 3)  # RandomResizedCrop's default aspect range
ERASE_SCALE, ERASE_RATIO = (0.02, 0.33), (0.3, 3.3)  # RandomErasing's defaults
ATTEMPTS = 10  # RandomResizedCrop's and RandomErasing's tries before their fallbacks
MAX_SUPERSAMPLING = 3  # samples per output pixel per side: antialias for downscaling by up to 3x

# RandAugment's ops, in torchvision's order (_AUGMENTATION_SPACE): (name, geometric, signed, magnitude at bin m of 31)
OPS = (
    ("Identity", False, False, lambda m, size: 0.0),
    ("ShearX", True, True, lambda m, size: 0.3 * m / 30),
    ("ShearY", True, True, lambda m, size: 0.3 * m / 30),
    ("TranslateX", True, True, lambda m, size: 150.0 / 331.0 * size * m / 30),
    ("TranslateY", True, True, lambda m, size: 150.0 / 331.0 * size * m / 30),
    ("Rotate", True, True, lambda m, size: 30.0 * m / 30),
    ("Brightness", False, True, lambda m, size: 0.9 * m / 30),
    ("Color", False, True, lambda m, size: 0.9 * m / 30),
    ("Contrast", False, True, lambda m, size: 0.9 * m / 30),
    ("Sharpness", False, True, lambda m, size: 0.9 * m / 30),
    ("Posterize", False, False, lambda m, size: float(round(8 - m / 7.5))),
    ("Solarize", False, False, lambda m, size: 1.0 - m / 30),
    ("AutoContrast", False, False, lambda m, size: 0.0),
    ("Equalize", False, False, lambda m, size: 0.0),
)
OP_NAMES = tuple(name for name, *_ in OPS)


@dataclass(frozen=True)
class StepKey:
    """What a step's draws are a function of, and nothing else (not the worker count, not the device)."""

    seed: int
    epoch: int
    rank: int
    step: int

    def generator(self) -> np.random.Generator:
        # SeedSequence takes non-negative integers; a negative --seed (torch.manual_seed takes it) wraps
        return np.random.default_rng(np.random.SeedSequence([self.seed % 2**64, self.epoch, self.rank, self.step]))


@dataclass
class Draws:
    """Every random choice of one batch (B images), in source pixels and RandAugment's own units."""

    crop: np.ndarray  # (B, 4) top, left, height, width of each image's crop (whole pixels, as torchvision's)
    flip: np.ndarray  # (B,) bool
    ops: np.ndarray  # (B, n) index into OPS
    magnitudes: np.ndarray  # (B, n) signed magnitude of each op (0 for ops without one)
    erase: np.ndarray  # (B, 4) top, left, height, width of the erased box; height 0 where nothing is erased
    mix: tuple[str, float, tuple[int, int, int, int] | None]  # ("none" | "mixup" | "cutmix", lambda, CutMix box)


def draw(aug: Augmentation, sizes: np.ndarray, *, image_size: int, key: StepKey, eval_crop: np.ndarray) -> Draws:
    """The draws for images of `sizes` (B, 2) (height, width). `eval_crop` (B, 4): each image's crop when the
    recipe does not crop at random (crop_scale 1: the eval geometry)."""
    rng = key.generator()
    count = len(sizes)
    crop = random_resized_crops(rng, sizes, (aug.crop_scale, 1.0)) if aug.crop_scale < 1 else eval_crop
    flip = rng.random(count) < 0.5 if aug.hflip else np.zeros(count, dtype=bool)
    ops, magnitudes = randaugment_draws(rng, count, aug.randaugment_ops, aug.randaugment_magnitude, image_size)
    erase = erasing_boxes(rng, count, image_size, aug.random_erasing)
    return Draws(crop, flip, ops, magnitudes, erase, mix_draw(rng, aug, image_size))


def random_resized_crops(rng: np.random.Generator, sizes: np.ndarray, scale: tuple[float, float]) -> np.ndarray:
    """RandomResizedCrop.make_params for every image at once: ATTEMPTS tries of (area, log-aspect), the first that
    fits, else the central crop of the aspect range's nearest ratio."""
    heights, widths = sizes[:, 0:1].astype(np.float64), sizes[:, 1:2].astype(np.float64)  # (B, 1)
    count = len(sizes)
    area = heights * widths * rng.uniform(scale[0], scale[1], (count, ATTEMPTS))
    aspect = np.exp(rng.uniform(math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]), (count, ATTEMPTS)))
    w, h = np.round(np.sqrt(area * aspect)), np.round(np.sqrt(area / aspect))  # (B, ATTEMPTS)
    fits = (w > 0) & (w <= widths) & (h > 0) & (h <= heights)
    first = fits.argmax(1)  # the first attempt that fits (0 if none does: replaced below)
    rows = np.arange(count)
    w, h = w[rows, first], h[rows, first]
    top = np.floor(rng.random(count) * (heights[:, 0] - h + 1))
    left = np.floor(rng.random(count) * (widths[:, 0] - w + 1))
    crop = np.stack([top, left, h, w], 1)
    none_fit = ~fits.any(1)
    crop[none_fit] = central_crops(sizes[none_fit])
    return crop


def central_crops(sizes: np.ndarray) -> np.ndarray:
    """RandomResizedCrop's fallback: the central crop with the aspect ratio clamped to CROP_RATIO."""
    heights, widths = sizes[:, 0].astype(np.float64), sizes[:, 1].astype(np.float64)
    ratio = widths / heights
    narrow, wide = ratio < CROP_RATIO[0], ratio > CROP_RATIO[1]
    w = np.where(wide, np.round(heights * CROP_RATIO[1]), widths)
    h = np.where(narrow, np.round(widths / CROP_RATIO[0]), heights)
    return np.stack([(heights - h) // 2, (widths - w) // 2, h, w], 1)


def randaugment_draws(rng, count: int, num_ops: int, magnitude: int, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(B, n) op indices, uniform over OPS with replacement, and their magnitudes at bin `magnitude`, each signed op
    negated with probability 1/2 (RandAugment.forward)."""
    ops = rng.integers(0, len(OPS), (count, num_ops))
    negate = rng.random((count, num_ops)) < 0.5
    base = np.array([value(magnitude, image_size) for _, _, _, value in OPS])
    signed = np.array([is_signed for _, _, is_signed, _ in OPS])
    return ops, np.where(signed[ops] & negate, -base[ops], base[ops])


def erasing_boxes(rng, count: int, image_size: int, probability: float) -> np.ndarray:
    """RandomErasing.make_params for every image: erased with `probability`, ATTEMPTS tries at a box that fits."""
    area = image_size * image_size * rng.uniform(*ERASE_SCALE, (count, ATTEMPTS))
    aspect = np.exp(rng.uniform(math.log(ERASE_RATIO[0]), math.log(ERASE_RATIO[1]), (count, ATTEMPTS)))
    h, w = np.round(np.sqrt(area * aspect)), np.round(np.sqrt(area / aspect))
    fits = (h < image_size) & (w < image_size)
    first, rows = fits.argmax(1), np.arange(count)
    h, w = h[rows, first], w[rows, first]
    top = np.floor(rng.random(count) * (image_size - h + 1))
    left = np.floor(rng.random(count) * (image_size - w + 1))
    erased = (rng.random(count) < probability) & fits.any(1)
    return np.stack([top, left, np.where(erased, h, 0), np.where(erased, w, 0)], 1)


def mix_draw(rng, aug: Augmentation, image_size: int) -> tuple[str, float, tuple[int, int, int, int] | None]:
    """One of MixUp and CutMix for the batch (each with probability 1/2 when both are on), torchvision's draws: lambda
    from Beta(alpha, alpha), and for CutMix a box around a uniform centre, lambda adjusted to the box's area."""
    kinds = [kind for kind, alpha in (("mixup", aug.mixup_alpha), ("cutmix", aug.cutmix_alpha)) if alpha > 0]
    if not kinds:
        return ("none", 1.0, None)
    kind = kinds[int(rng.integers(len(kinds)))]
    alpha = aug.mixup_alpha if kind == "mixup" else aug.cutmix_alpha
    lam = float(rng.beta(alpha, alpha))
    if kind == "mixup":
        return (kind, lam, None)
    centre_x, centre_y = int(rng.integers(image_size)), int(rng.integers(image_size))
    half = int(0.5 * math.sqrt(1.0 - lam) * image_size)
    x1, y1 = max(centre_x - half, 0), max(centre_y - half, 0)
    x2, y2 = min(centre_x + half, image_size), min(centre_y + half, image_size)
    return (kind, 1.0 - (x2 - x1) * (y2 - y1) / image_size**2, (x1, y1, x2, y2))


# --- the geometry: one inverse affine map per image, in pixel-index coordinates (x right, y down) -------------------


def _affine(count: int) -> np.ndarray:
    return np.tile(np.eye(3), (count, 1, 1))  # (B, 3, 3)


def randaugment_geometry(ops: np.ndarray, magnitudes: np.ndarray, image_size: int) -> np.ndarray:
    """(B, max(n, 1), 3, 3): output pixel -> pixel of the S x S frame each RandAugment op read from. Entry 0 maps to
    the cropped frame (all n ops composed, in the order drawn); entry j > 0 to the frame op j+1 read (ops j+1..n
    composed), so a pixel that an earlier op filled black stays black when a later op moves it back (torchvision fills
    it at that op). Each op is torchvision's inverse map (v2.functional.affine with center [0, 0] for the shears,
    rotate about the centre: transforms.functional._get_inverse_affine_matrix), written about the frame's centre."""
    count, slots, centre = len(ops), ops.shape[1], image_size / 2 - 0.5
    to_centre, from_centre = _affine(1)[0], _affine(1)[0]
    to_centre[:2, 2], from_centre[:2, 2] = -centre, centre
    steps = [from_centre @ op_inverse(ops[:, slot], magnitudes[:, slot], image_size) @ to_centre
             for slot in range(slots)]  # fmt: skip
    partial, frames = _affine(count), []
    for step in reversed(steps):  # op n maps first: its input is what op n-1 wrote
        partial = step @ partial
        frames.insert(0, partial)
    return np.stack(frames or [partial], 1)


def op_inverse(ops: np.ndarray, magnitudes: np.ndarray, image_size: int) -> np.ndarray:
    """(B, 3, 3): one slot's ops as inverse maps about the frame's centre (identity for colour ops)."""
    name, m = np.array(OP_NAMES)[ops], magnitudes
    step = _affine(len(ops))
    step[:, 0, 1] = np.where(name == "ShearX", m, 0.0)
    step[:, 0, 2] = np.where(name == "ShearX", m * image_size / 2, 0.0)
    step[:, 1, 0] = np.where(name == "ShearY", m, 0.0)
    step[:, 1, 2] = np.where(name == "ShearY", m * image_size / 2, 0.0)
    step[:, 0, 2] -= np.where(name == "TranslateX", np.trunc(m), 0.0)  # torchvision translates by int(m) pixels
    step[:, 1, 2] -= np.where(name == "TranslateY", np.trunc(m), 0.0)
    rotating = name == "Rotate"
    angle = np.radians(-m[rotating])  # v2's rotate_image passes -angle to the inverse matrix
    step[rotating, 0, 0], step[rotating, 0, 1] = np.cos(angle), np.sin(angle)
    step[rotating, 1, 0], step[rotating, 1, 1] = -np.sin(angle), np.cos(angle)
    return step


def crop_and_flip(crop: np.ndarray, flip: np.ndarray, image_size: int) -> np.ndarray:
    """(B, 3, 3): pixel of the S x S frame -> source pixel: the horizontal flip, then the crop's resize (half-pixel
    centres, as torch's interpolate with align_corners=False)."""
    count = len(crop)
    flipping = _affine(count)
    flipping[flip, 0, 0], flipping[flip, 0, 2] = -1.0, image_size - 1
    top, left, height, width = crop.T
    resize = _affine(count)
    resize[:, 0, 0], resize[:, 0, 2] = width / image_size, 0.5 * width / image_size - 0.5 + left
    resize[:, 1, 1], resize[:, 1, 2] = height / image_size, 0.5 * height / image_size - 0.5 + top
    return resize @ flipping


def supersampling(crop: np.ndarray, image_size: int) -> int:
    """Samples per output pixel and side: the batch's largest downscale, rounded up (bilinear sampling aliases beyond
    a factor of about 1.5; torchvision's antialiased resize widens its filter instead)."""
    largest = float(crop[:, 2:].max()) / image_size if len(crop) else 1.0
    return int(min(max(math.ceil(largest - 0.25), 1), MAX_SUPERSAMPLING))


RESAMPLE_CHUNK = 64  # images converted to float and sampled at a time: bounds the float copy of a large canvas


def resample(canvas: Tensor, sizes: Tensor, to_source: Tensor, frames: Tensor, image_size: int, factor: int) -> Tensor:
    """canvas uint8 (B, 3, H, W), image b in its top-left sizes[b] = (h, w) -> float (B, 3, S, S) in [0, 1]: each
    output pixel the mean of factor^2 bilinear samples at to_source(p); 0 (black) where any of `frames` (B, m, 3, 3)
    takes p out of its S x S frame (RandAugment's fill)."""
    batch, _, height, width = canvas.shape
    side = image_size * factor
    offsets = (torch.arange(side, device=canvas.device, dtype=torch.float32) + 0.5) / factor - 0.5  # (S f,)
    y, x = torch.meshgrid(offsets, offsets, indexing="ij")
    points = torch.stack([x, y, torch.ones_like(x)], -1)  # (S f, S f, 3)
    source = torch.einsum("bij,hwj->bhwi", to_source[:, :2], points)  # (B, S f, S f, 2) source x, y
    framed = torch.einsum("bmij,hwj->bmhwi", frames[:, :, :2], points)  # (B, m, S f, S f, 2)
    inside = ((framed >= -0.5) & (framed <= image_size - 0.5)).all(-1).all(1)  # (B, S f, S f)
    limits = (sizes.flip(-1) - 1).to(torch.float32)[:, None, None, :]  # (B, 1, 1, 2) largest x, y of each image
    source = torch.minimum(source.clamp(min=0), limits)  # half a pixel past an edge samples the edge
    # align_corners=True: -1 and 1 are the canvas's first and last pixel centres
    grid = torch.stack([source[..., 0] * (2 / max(width - 1, 1)), source[..., 1] * (2 / max(height - 1, 1))], -1) - 1
    out = canvas.new_empty((batch, 3, image_size, image_size), dtype=torch.float32)
    for start in range(0, batch, RESAMPLE_CHUNK):
        chunk = slice(start, start + RESAMPLE_CHUNK)
        sampled = torch.nn.functional.grid_sample(canvas[chunk].float(), grid[chunk], mode="bilinear",
                                                  align_corners=True)  # fmt: skip
        sampled = sampled * inside[chunk, None]  # (b, 3, S f, S f)
        out[chunk] = torch.nn.functional.avg_pool2d(sampled, factor) if factor > 1 else sampled
    return out.div_(255).clamp_(0, 1)


# --- colour, normalisation, erasing, mixing ---------------------------------------------------------------------


def colour_kernel(name: str, magnitude: float):
    """RandAugment's colour op `name` at `magnitude`, as torchvision's _apply_image_or_video_transform calls it on a
    float image (bound 1)."""
    from torchvision.transforms.v2 import functional as F

    kernels = {
        "Brightness": lambda x: F.adjust_brightness(x, brightness_factor=1.0 + magnitude),
        "Color": lambda x: F.adjust_saturation(x, saturation_factor=1.0 + magnitude),
        "Contrast": lambda x: F.adjust_contrast(x, contrast_factor=1.0 + magnitude),
        "Sharpness": lambda x: F.adjust_sharpness(x, sharpness_factor=1.0 + magnitude),
        "Posterize": lambda x: F.posterize(x, bits=int(magnitude)),
        "Solarize": lambda x: F.solarize(x, threshold=magnitude),
        "AutoContrast": F.autocontrast,
        "Equalize": F.equalize,
    }
    return kernels[name]


def colour_groups(ops: np.ndarray, magnitudes: np.ndarray) -> list[tuple[str, float, np.ndarray]]:
    """(op name, magnitude, image indices) for each slot's colour ops in slot order: the images that drew the same op
    with the same signed magnitude in a slot go through torchvision's kernel together."""
    groups = []
    for slot in range(ops.shape[1]):
        for op in np.unique(ops[:, slot]):
            name, geometric = OPS[op][0], OPS[op][1]
            if geometric or name == "Identity":
                continue
            for magnitude in np.unique(magnitudes[ops[:, slot] == op, slot]):
                chosen = np.nonzero((ops[:, slot] == op) & (magnitudes[:, slot] == magnitude))[0]
                groups.append((name, float(magnitude), chosen))
    return groups


def erase(images: Tensor, boxes: Tensor) -> Tensor:
    """Each image's box (top, left, height, width; height 0: none) set to 0 (after normalising: the mean pixel)."""
    side = images.shape[-1]
    index = torch.arange(side, device=images.device, dtype=boxes.dtype)
    top, left, height, width = (boxes[:, k, None] for k in range(4))  # (B, 1) each
    rows = (index >= top) & (index < top + height)  # (B, S)
    columns = (index >= left) & (index < left + width)
    return images.masked_fill(rows[:, None, :, None] & columns[:, None, None, :], 0.0)


def mix(images: Tensor, targets: Tensor, draw_: tuple[str, float, tuple[int, int, int, int] | None]):
    """MixUp or CutMix with the batch rolled by one, as torchvision's v2.MixUp / v2.CutMix mix images and targets."""
    kind, lam, box = draw_
    if kind == "none":
        return images, targets
    mixed_targets = targets.roll(1, 0).mul(1.0 - lam).add_(targets.mul(lam))
    if kind == "mixup":
        return images.roll(1, 0).mul_(1.0 - lam).add_(images.mul(lam)), mixed_targets
    x1, y1, x2, y2 = box
    images = images.clone()
    images[..., y1:y2, x1:x2] = images.roll(1, 0)[..., y1:y2, x1:x2]
    return images, mixed_targets


class BatchAugment:
    """Applies a step's draws to images of one size S with the data's mean and std, on `device`."""

    def __init__(self, *, image_size: int, mean, std, num_classes: int, device: torch.device):
        self.image_size, self.num_classes, self.device = image_size, num_classes, device
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device)[:, None, None]
        self.std = torch.tensor(std, dtype=torch.float32, device=device)[:, None, None]

    def apply(self, canvas: Tensor, sizes: Tensor, draws: Draws, labels: Tensor) -> tuple[Tensor, Tensor]:
        """canvas uint8 (B, 3, H, W) on the device, image b in its top-left sizes[b] = (h, w) -> (augmented normalised
        images (B, 3, S, S), targets (B, C)). The draws reach the device in one copy; nothing is read back."""
        size = self.image_size
        frames = randaugment_geometry(draws.ops, draws.magnitudes, size)  # (B, m, 3, 3)
        to_source = crop_and_flip(draws.crop, draws.flip, size) @ frames[:, 0]
        groups = colour_groups(draws.ops, draws.magnitudes)
        to_source, frames, boxes, indices = self._to_device(to_source, frames, draws.erase, groups)
        images = resample(canvas, sizes.to(self.device, non_blocking=True), to_source, frames, size,
                          supersampling(draws.crop, size))  # fmt: skip
        for (name, magnitude, _), chosen in zip(groups, indices, strict=True):
            images.index_copy_(0, chosen, colour_kernel(name, magnitude)(images.index_select(0, chosen)))
        images = erase(images.sub_(self.mean).div_(self.std), boxes)
        targets = torch.nn.functional.one_hot(labels.to(self.device, non_blocking=True), self.num_classes).float()
        return mix(images, targets, draws.mix)

    def _to_device(self, to_source, frames, boxes, groups) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
        """The step's maps, erasing boxes and group indices, each in one pinned host buffer copied without a sync."""
        floats = torch.from_numpy(np.concatenate([to_source.ravel(), frames.ravel(), boxes.ravel()])).float()
        counts = [len(chosen) for _, _, chosen in groups]
        ints = torch.from_numpy(np.concatenate([chosen for _, _, chosen in groups] or [np.zeros(0, np.int64)]))
        if self.device.type == "cuda":
            floats, ints = floats.pin_memory(), ints.pin_memory()
        floats = floats.to(self.device, non_blocking=True)
        ints = ints.to(self.device, dtype=torch.long, non_blocking=True)
        count, maps = len(to_source), frames.shape[1]
        to_source, rest = floats[: 9 * count].view(count, 3, 3), floats[9 * count :]
        frames, boxes = rest[: 9 * count * maps].view(count, maps, 3, 3), rest[9 * count * maps :].view(count, 4)
        return to_source, frames, boxes, list(ints.split(counts))
