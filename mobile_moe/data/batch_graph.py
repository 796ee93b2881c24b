"""The device half of `train --input-pipeline crop` (inputs.py): everything after the crop, on a batch of fixed shape
(B, S, S, 3) uint8, as ONE graph whose operations do not depend on the draws: RandAugment with each image's own ops and
magnitudes, normalisation, random erasing, MixUp or CutMix. The draws arrive as tensors (GraphParams, made in the
worker by `params`), so `torch.compile(fullgraph=True, dynamic=False)` traces it once and no batch recompiles it.

RandAugment is torchvision's v2.RandAugment on uint8 images, slot by slot in the order drawn: each slot resamples every
image through its own inverse affine map (the identity for a colour op; nearest-neighbour, black fill, as torchvision's
RandAugment), then computes all eight colour operations for the whole batch with per-image parameters and keeps, for
each image, the one it drew (`torch.where`). Values stay integers in [0, 255] between operations, truncated as
torchvision's uint8 kernels truncate, so an image matches torchvision's per-image result up to float rounding at a
level boundary (the tests state by how much). Computing eight operations where one is kept costs eight times the
arithmetic of grouping images by operation, but keeps the graph fixed; on a GPU the batch is ~40 MB, a few
microseconds of memory traffic per pass.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from mobile_moe.data import batch_augment
from mobile_moe.data.batch_augment import OP_NAMES, OPS, Draws

# Colour operations by their index in batch_augment.OPS; 0 (Identity) where a slot's op is geometric or the identity
COLOUR = {name: OP_NAMES.index(name) for name, geometric, *_ in OPS if not geometric and name != "Identity"}


@dataclass
class GraphParams:
    """One batch's draws as the graph's tensors (B images, n RandAugment slots)."""

    theta: Tensor  # (B, n, 2, 3) float32: each slot's inverse map, centred pixel coordinates (torchvision's affine)
    colour: Tensor  # (B, n) int64: the slot's colour op (index into OPS), 0 for none
    factor: Tensor  # (B, n) float32: its parameter (blend factor; posterize's quantum; solarize's threshold)
    erase: Tensor  # (B, 4) float32: top, left, height, width of the erased box; height 0 where none
    mix: Tensor  # (6,) float32: image weight (MixUp's lambda, else 1), target weight, CutMix box x1, y1, x2, y2

    def pin_memory(self) -> GraphParams:
        return GraphParams(**{f.name: getattr(self, f.name).pin_memory() for f in fields(self)})

    def to(self, device: torch.device) -> GraphParams:
        return GraphParams(**{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)})


def params(draws: Draws, image_size: int) -> GraphParams:
    """The graph's parameters for `draws` (their crop and flip were applied in the worker)."""
    count, slots = draws.ops.shape
    theta = np.zeros((count, slots, 2, 3))
    colour = np.zeros((count, slots), dtype=np.int64)
    factor = np.zeros((count, slots))
    for slot in range(slots):
        ops, magnitudes = draws.ops[:, slot], draws.magnitudes[:, slot]
        theta[:, slot] = batch_augment._op_inverse(ops, magnitudes, image_size)[:, :2]
        names = np.array(OP_NAMES)[ops]
        colour[:, slot] = np.where(np.isin(names, list(COLOUR)), ops, 0)
        factor[:, slot] = np.select(
            [names == "Posterize", names == "Solarize"],
            [2.0 ** (8 - np.trunc(magnitudes)), 255.0 * magnitudes],  # torchvision: bits int(m); threshold 255 m
            1.0 + magnitudes,
        )
    kind, lam, box = draws.mix
    mix = [lam if kind == "mixup" else 1.0, lam, *(box or (0, 0, 0, 0))]
    return GraphParams(torch.from_numpy(theta).float(), torch.from_numpy(colour), torch.from_numpy(factor).float(),
                       torch.from_numpy(draws.erase).float(), torch.tensor(mix, dtype=torch.float32))  # fmt: skip


# --- RandAugment, batched ---------------------------------------------------------------------------------------


def geometric(images: Tensor, theta: Tensor) -> Tensor:
    """(B, 3, S, S) integer-valued float through each image's inverse map (B, 2, 3): torchvision's affine_image grid
    (_affine_grid: centred pixel coordinates, normalised by S / 2), nearest neighbour, 0 outside."""
    size = images.shape[-1]
    centred = torch.linspace((1.0 - size) * 0.5, (size - 1.0) * 0.5, size, device=images.device)
    y, x = torch.meshgrid(centred, centred, indexing="ij")
    base = torch.stack([x, y, torch.ones_like(x)], -1).view(1, size * size, 3)  # (1, S S, 3)
    grid = base.expand(len(theta), -1, -1).bmm(theta.transpose(1, 2) / (0.5 * size))  # (B, S S, 2)
    sampled = F.grid_sample(images, grid.view(-1, size, size, 2), mode="nearest", padding_mode="zeros",
                            align_corners=False)  # fmt: skip
    return sampled.round()


def _grey(images: Tensor) -> Tensor:
    """torchvision's _rgb_to_grayscale_image on a uint8 image (floored): (B, 1, S, S)."""
    red, green, blue = images.unbind(1)
    return (red * 0.2989 + green * 0.587 + blue * 0.114).floor().unsqueeze(1)


def _blend(images: Tensor, other: Tensor, ratio: Tensor) -> Tensor:
    """torchvision's _blend for uint8 images: ratio x + (1 - ratio) y, clamped, truncated."""
    return (images * ratio + other * (1.0 - ratio)).clamp(0, 255).floor()


def _sharpened(images: Tensor, ratio: Tensor) -> Tensor:
    """torchvision's adjust_sharpness_image for uint8: the interior blended with its rounded 3 x 3 smoothing."""
    kernel = torch.full((3, 3), 1.0 / 13.0, device=images.device)
    kernel[1, 1] = 5.0 / 13.0
    blurred = F.conv2d(images, kernel.expand(3, 1, 3, 3), groups=3).round()
    inner = images[..., 1:-1, 1:-1]
    inner = inner + (blurred - inner) * (1.0 - ratio)
    return F.pad(inner, (1, 1, 1, 1)).where(_interior(images), images).clamp(0, 255).floor()


def _interior(images: Tensor) -> Tensor:
    size = images.shape[-1]
    edge = torch.zeros(size, dtype=torch.bool, device=images.device)
    edge[1:-1] = True
    return edge[:, None] & edge[None, :]


def colour(images: Tensor, ops: Tensor, factor: Tensor) -> Tensor:
    """Each image through the colour op `ops[b]` (COLOUR's indices; 0 none) at `factor[b]`, all eight computed."""
    from torchvision.transforms.v2 import functional as TF

    ratio = factor[:, None, None, None]
    as_uint8 = images.to(torch.uint8)
    results = {
        "Brightness": (images * ratio).clamp(0, 255).floor(),
        "Color": _blend(images, _grey(images), ratio),
        "Contrast": _blend(images, _grey(images).mean((-3, -2, -1), keepdim=True), ratio),
        "Sharpness": _sharpened(images, ratio),
        "Posterize": (images / ratio).floor() * ratio,  # ratio: 2 ** (8 - bits), a power of two: exact
        "Solarize": torch.where(images >= ratio, 255.0 - images, images),
        "AutoContrast": TF.autocontrast_image(as_uint8).float(),
        "Equalize": TF.equalize_image(as_uint8).float(),
    }
    out = images
    for name, result in results.items():
        out = torch.where((ops == COLOUR[name])[:, None, None, None], result, out)
    return out


# --- the rest: normalisation, erasing, mixing -------------------------------------------------------------------


def mixed(images: Tensor, targets: Tensor, mix: Tensor) -> tuple[Tensor, Tensor]:
    """torchvision's MixUp / CutMix with the batch rolled by one, from `mix` (GraphParams.mix): the images blended by
    its image weight outside the CutMix box and the partner's inside it; the targets by its target weight."""
    image_weight, target_weight = mix[0], mix[1]
    size = images.shape[-1]
    index = torch.arange(size, device=images.device, dtype=mix.dtype)
    inside = ((index >= mix[3]) & (index < mix[5]))[:, None] & ((index >= mix[2]) & (index < mix[4]))[None, :]
    partner = images.roll(1, 0)
    images = torch.where(inside, partner, partner * (1.0 - image_weight) + images * image_weight)
    return images, targets.roll(1, 0) * (1.0 - target_weight) + targets * target_weight


class BatchGraph(torch.nn.Module):
    """(B, S, S, 3) uint8 cropped images, labels and GraphParams -> (normalised images (B, 3, S, S), targets (B, C)),
    a fixed sequence of operations (compile it with torch.compile(fullgraph=True, dynamic=False))."""

    def __init__(self, *, mean, std, num_classes: int):
        super().__init__()
        self.num_classes = num_classes
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32)[:, None, None], persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32)[:, None, None], persistent=False)

    def forward(self, images: Tensor, labels: Tensor, theta: Tensor, ops: Tensor, factor: Tensor, erase: Tensor,
                mix: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
        x = images.permute(0, 3, 1, 2).float()
        for slot in range(theta.shape[1]):
            x = colour(geometric(x, theta[:, slot]), ops[:, slot], factor[:, slot])
        x = batch_augment.erase((x / 255.0 - self.mean) / self.std, erase)
        targets = F.one_hot(labels, self.num_classes).float()
        return mixed(x, targets, mix)
