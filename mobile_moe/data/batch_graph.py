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
microseconds of memory traffic per pass. On a CPU, where a fixed graph buys nothing, BatchGraph(fixed_shape=False)
computes the same values image by image, each image through only the operations it drew.
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
        theta[:, slot] = batch_augment.op_inverse(ops, magnitudes, image_size)[:, :2]
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
    """(B, C, S, S) images of any dtype through each image's inverse map (B, 2, 3), nearest neighbour, 0 outside: the
    values of torchvision's affine_image on uint8 (its _affine_grid in centred pixel coordinates, grid_sample nearest,
    zeros), as one gather of source pixels from the image padded with a black pixel a side (grid_sample takes floats
    only, and costs more on a CPU). The identity map returns an image unchanged."""
    batch, channels, size, _ = images.shape
    index = source_pixels(theta, size).view(batch, 1, -1).expand(-1, channels, -1)
    return F.pad(images, (1, 1, 1, 1)).flatten(2).gather(2, index).view_as(images)


def source_pixels(theta: Tensor, size: int) -> Tensor:
    """(B, S S) int64: for every output pixel, the flat index of its nearest source pixel in the image padded by one
    pixel a side ((S + 2) x (S + 2)), a border pixel where it falls outside the image: theta @ (x, y, 1) in centred
    pixel coordinates, moved to pixel indices, rounded half to even and clamped to the border. grid_sample's nearest
    rounds the same point (std::nearbyint) after normalising it to [-1, 1] and back, so a point within float rounding
    of a half-pixel boundary can take the neighbouring pixel there."""
    centred = torch.linspace((1.0 - size) * 0.5, (size - 1.0) * 0.5, size, device=theta.device)
    # the terms of output column j and of output row i (with the shift and the half-size that makes them indices)
    columns = theta[:, :, None, 0] * centred  # (B, 2, S)
    rows = theta[:, :, None, 1] * centred + (theta[:, :, None, 2] + (size - 1.0) * 0.5)
    x = (rows[:, 0, :, None] + columns[:, 0, None, :]).round_().clamp_(-1, size)  # (B, S, S); -1 and S: the border
    y = (rows[:, 1, :, None] + columns[:, 1, None, :]).round_().clamp_(-1, size)
    return y.mul_(size + 2).add_(x).add_(size + 3).long().flatten(1)  # (y + 1) (S + 2) + (x + 1)


def _grey(images: Tensor) -> Tensor:
    """torchvision's _rgb_to_grayscale_image on a uint8 image (floored): (B, 1, S, S)."""
    red, green, blue = images.unbind(1)
    return (red * 0.2989 + green * 0.587 + blue * 0.114).floor().unsqueeze(1)


def _mean_grey(images: Tensor) -> Tensor:
    """Each image's mean grey level (B, 1, 1, 1), summed in float64: exact whatever the order of the sum (a batch's or
    one image's, any threads), where float32 is exact only up to 2^24 / 255 pixels (256 x 256)."""
    return _grey(images).mean((-3, -2, -1), keepdim=True, dtype=torch.float64).float()


def _blend(images: Tensor, other: Tensor, ratio: Tensor) -> Tensor:
    """torchvision's _blend for uint8 images: ratio x + (1 - ratio) y, clamped, truncated."""
    return (images * ratio + other * (1.0 - ratio)).clamp(0, 255).floor()


def _sharpened(images: Tensor, ratio: Tensor) -> Tensor:
    """torchvision's adjust_sharpness_image for uint8: the interior blended with its rounded 3 x 3 smoothing (weights
    1/13, centre 5/13). The smoothing is a sum of whole numbers, exact in float32, divided by 13 (never half-way
    between two levels, so it rounds as torchvision's convolution does): two shifted sums, not a depthwise
    convolution, which costs ~4 ms an image on a CPU."""
    rows = images[..., :, :-2] + images[..., :, 1:-1] + images[..., :, 2:]  # (B, 3, S, S - 2)
    inner = images[..., 1:-1, 1:-1]
    blurred = ((rows[..., :-2, :] + rows[..., 1:-1, :] + rows[..., 2:, :] + 4.0 * inner) / 13.0).round()
    sharpened = images.clone()  # the border as it is (a copy and a slice, where torch.where is a scalar loop on CPUs)
    sharpened[..., 1:-1, 1:-1] = inner + (blurred - inner) * (1.0 - ratio)
    return sharpened.clamp_(0, 255).floor_()


def _solarized(images: Tensor, threshold: Tensor) -> Tensor:
    """torchvision's solarize_image: 255 - x where x >= threshold. As arithmetic on whole numbers (exact in float32):
    ATen's CPU torch.where is a scalar loop (the op took 0.55 ms a 224 px image with it, 0.15 ms so)."""
    return (255.0 - 2.0 * images).mul_(images >= threshold).add_(images)


COLOUR_OPS = {
    "Brightness": lambda x, ratio: (x * ratio).clamp(0, 255).floor(),
    "Color": lambda x, ratio: _blend(x, _grey(x), ratio),
    "Contrast": lambda x, ratio: _blend(x, _mean_grey(x), ratio),
    "Sharpness": _sharpened,
    "Posterize": lambda x, ratio: (x / ratio).floor() * ratio,  # ratio: 2 ** (8 - bits), a power of two: exact
    "Solarize": _solarized,
    "AutoContrast": lambda x, ratio: _autocontrast(x),
    "Equalize": lambda x, ratio: _equalized(x),
}


def _autocontrast(images: Tensor) -> Tensor:
    """torchvision's autocontrast_image for uint8, whose arithmetic is float32's: each channel stretched from its
    (min, max) to (0, 255), a flat channel left as it is, truncated."""
    low, high = images.amin((-2, -1), keepdim=True), images.amax((-2, -1), keepdim=True)
    flat = high == low
    inverse_scale = torch.where(flat, 1.0, (high - low) * (1.0 / 255.0))
    return ((images - torch.where(flat, 0.0, low)) / inverse_scale).clamp(0, 255).floor()


def _equalized(images: Tensor) -> Tensor:
    """torchvision's equalize_image (a histogram lookup: integer arithmetic on uint8) on integer-valued floats."""
    from torchvision.transforms.v2 import functional as TF

    return TF.equalize_image(images.to(torch.uint8)).float()


def colour(images: Tensor, ops: Tensor, factor: Tensor) -> Tensor:
    """Each image through the colour op `ops[b]` (COLOUR's indices; 0 none) at `factor[b]`: all eight computed for
    every image, each keeping its own (one graph whatever the draws)."""
    ratio = factor[:, None, None, None]
    out = images
    for name, op in COLOUR_OPS.items():
        out = torch.where((ops == COLOUR[name])[:, None, None, None], op(images, ratio), out)
    return out


# --- the rest: normalisation, erasing, mixing -------------------------------------------------------------------


def mixed(images: Tensor, targets: Tensor, mix: Tensor) -> tuple[Tensor, Tensor]:
    """torchvision's MixUp / CutMix with the batch rolled by one, from `mix` (GraphParams.mix): the images blended by
    its image weight outside the CutMix box and the partner's inside it; the targets by its target weight."""
    size = images.shape[-1]
    index = torch.arange(size, device=images.device, dtype=mix.dtype)
    inside = ((index >= mix[3]) & (index < mix[5]))[:, None] & ((index >= mix[2]) & (index < mix[4]))[None, :]
    partner = images.roll(1, 0)
    images = torch.where(inside, partner, partner * (1.0 - mix[0]) + images * mix[0])
    return images, mixed_targets(targets, mix)


def mixed_targets(targets: Tensor, mix: Tensor) -> Tensor:
    return targets.roll(1, 0) * (1.0 - mix[1]) + targets * mix[1]


def mixed_in_place(images: Tensor, targets: Tensor, mix: Tensor) -> tuple[Tensor, Tensor]:
    """`mixed` on a host's batch, in place: a MixUp blends the whole batch, a CutMix copies only its box, no mixing
    leaves the images as they are (the same values as `mixed`: x * 1 + partner * 0 is x). Its temporaries are one
    image's: a batch-sized one is paged in afresh on each batch."""
    x1, y1, x2, y2 = (int(v) for v in mix[2:].tolist())
    if x2 > x1 and y2 > y1:
        images[..., y1:y2, x1:x2] = images[..., y1:y2, x1:x2].roll(1, 0)
    elif float(mix[0]) != 1.0:  # image by image, downwards (image i - 1 is unmixed yet): no batch-sized partner
        weight, partner_weight = mix[0], 1.0 - mix[0]
        first_partner = images[-1] * partner_weight
        for index in range(len(images) - 1, 0, -1):
            images[index].mul_(weight).add_(images[index - 1] * partner_weight)
        images[0].mul_(weight).add_(first_partner)
    return images, mixed_targets(targets, mix)


def moved_maps(theta: Tensor) -> Tensor:
    """(B, n) bool: which of the inverse maps (B, n, 2, 3) are not the identity."""
    identity = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], device=theta.device)
    return (theta != identity).flatten(2).any(2)


class BatchGraph(torch.nn.Module):
    """(B, S, S, 3) uint8 cropped images, labels and GraphParams -> (normalised images (B, 3, S, S), targets (B, C)):
    with `fixed_shape`, a fixed sequence of operations (compile it with torch.compile(fullgraph=True,
    dynamic=False)); without, the same values image by image, each image through only the ops it drew (eager on a
    CPU, where a fixed graph buys nothing and costs eight colour ops per image)."""

    def __init__(self, *, mean, std, num_classes: int, fixed_shape: bool = True):
        super().__init__()
        self.num_classes, self.fixed_shape = num_classes, fixed_shape
        mean, std = (torch.tensor(v, dtype=torch.float32)[:, None, None] for v in (mean, std))
        self.register_buffer("scale", 1.0 / (255.0 * std), persistent=False)  # (x / 255 - mean) / std in two steps
        self.register_buffer("shift", mean / std, persistent=False)

    def forward(self, images: Tensor, labels: Tensor, theta: Tensor, ops: Tensor, factor: Tensor, erase: Tensor,
                mix: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
        targets = F.one_hot(labels, self.num_classes).float()
        if not self.fixed_shape:
            return self._per_image(images, targets, theta, ops, factor, erase, mix)
        x = images.permute(0, 3, 1, 2).float()
        for slot in range(theta.shape[1]):
            x = colour(geometric(x, theta[:, slot]), ops[:, slot], factor[:, slot])
        return mixed(batch_augment.erase(x * self.scale - self.shift, erase), targets, mix)

    def _per_image(self, images, targets, theta, ops, factor, erase, mix) -> tuple[Tensor, Tensor]:
        """forward's values on a host, image by image: only the RandAugment ops each image drew, on a float copy of
        its pixels, then normalised into the batch, erased and mixed in place. Every temporary is one image's, which
        stays in the cache; a batch's (B, 3, S, S) float temporary is a fresh mapping paged in on each pass (glibc
        maps blocks above 32 MB), which cost this path twice its arithmetic."""
        size = images.shape[1]
        out = torch.empty((len(images), 3, size, size), device=images.device)
        moved = moved_maps(theta).tolist()
        for index, (image, image_ops) in enumerate(zip(images, ops.tolist(), strict=True)):
            x = image.permute(2, 0, 1).float().contiguous()[None]  # (1, 3, S, S)
            for slot, op in enumerate(image_ops):
                if moved[index][slot]:  # an image's op in a slot is geometric or colour, never both
                    x = geometric(x, theta[index, slot, None])
                elif op:
                    x = COLOUR_OPS[OP_NAMES[op]](x, factor[index, slot])
            torch.mul(x[0], self.scale, out=out[index]).sub_(self.shift)
        for index, (top, left, height, width) in enumerate(erase.long().tolist()):
            out[index, :, top : top + height, left : left + width] = 0.0  # height 0: none
        return mixed_in_place(out, targets, mix)
