"""crop.batched_squares, a folder's device crops resized together (the thread preparing a folder's batches on CUDA spent
40-44 ms of host time a batch of 256 on a loop over the images): the same antialiased bilinear filter as torch's
float kernel (the one CUDA runs) within a level, in a number of operations that does not grow with the batch. Run on
the CPU as the device; tests/test_gpu.py runs it on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from photos import photographs
from torch.utils._python_dispatch import TorchDispatchMode

from mobile_moe.data import crop

SIZE = 64


def crops(count: int, seed: int = 0) -> tuple[list[torch.Tensor], list[tuple[int, int, int, int]]]:
    """Real photographs and noise, cut at random sizes: crops smaller than S (enlarged), as large, and up to 3.5 S
    (decode.source_side_limit's bound for the deit recipe), at odd offsets."""
    rng = np.random.default_rng(seed)
    photos = [torch.from_numpy(np.array(photo)).permute(2, 0, 1).contiguous() for photo in photographs()]
    images, pixels = [], []
    for index in range(count):
        source = photos[index % len(photos)]
        height, width = (int(v) for v in rng.integers(20, int(3.5 * SIZE), size=2))
        if index % 4 == 3:  # noise: every level next to every other
            image = torch.from_numpy(rng.integers(0, 256, (3, height + 7, width + 5), dtype=np.uint8))
        else:
            sides = zip(source.shape[1:], (height, width), strict=True)
            top, left = (int(rng.integers(0, side - extent)) for side, extent in sides)
            image = source[:, top : top + height + 7, left : left + width + 5].contiguous()
        left, top = int(rng.integers(0, 5)), int(rng.integers(0, 7))
        images.append(image)
        pixels.append((left, top, left + width, top + height))
    pixels[0] = (0, 0, SIZE, SIZE)
    images[0] = images[0][:, : SIZE + 7, : SIZE + 5].contiguous() if images[0].shape[1] > SIZE + 7 else images[0]
    return images, pixels


def float_kernel(image: torch.Tensor, box: tuple[int, int, int, int]) -> torch.Tensor:
    left, top, right, bottom = box
    region = image[None, :, top:bottom, left:right].float()
    resized = F.interpolate(region, size=(SIZE, SIZE), mode="bilinear", antialias=True, align_corners=False)
    return resized[0].round().clamp(0, 255).to(torch.uint8)


def test_the_batched_crops_are_the_float_kernels_within_a_level_and_torchvisions_within_one():
    images, pixels = crops(24)
    got = crop.batched_squares(images, pixels, SIZE)
    expected = torch.stack([float_kernel(image, box) for image, box in zip(images, pixels, strict=True)])
    off = (got.int() - expected.int()).abs()
    assert off.max() <= 1 and (off > 0).float().mean() < 1e-3
    per_image = crop.squares(images, pixels, SIZE)  # on the CPU: torchvision's resize of each crop, its uint8 path
    assert (got.int() - per_image.int()).abs().max() <= 1


def test_a_crop_shifted_by_a_pixel_or_transposed_is_not_the_same_crop():
    """The test above would pass a resize that ignored the boxes' offsets or swapped the axes: it must not."""
    images, pixels = crops(8, seed=1)
    got = crop.batched_squares(images, pixels, SIZE).int()
    shifted = [(left + 1, top, right + 1, bottom) for left, top, right, bottom in pixels]
    assert (crop.batched_squares(images, shifted, SIZE).int() - got).abs().max() > 10
    transposed = [image.transpose(1, 2).contiguous() for image in images]
    swapped = [(top, left, bottom, right) for left, top, right, bottom in pixels]
    expected = crop.batched_squares(transposed, swapped, SIZE).transpose(2, 3)
    assert (expected.int() - got).abs().max() <= 1


class Operations(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("count", [4, 32])
def test_the_operations_a_batch_do_not_grow_with_its_images(count):
    images, pixels = crops(count, seed=2)
    pixels = [(left, top, left + SIZE * 3, top + SIZE * 3) for left, top, _, _ in pixels]  # the same taps: 7
    images = [torch.zeros((3, SIZE * 3 + 10, SIZE * 3 + 10), dtype=torch.uint8) for _ in images]
    with Operations() as operations:
        crop.batched_squares(images, pixels, SIZE)
    with Operations() as few:
        crop.batched_squares(images[:2], pixels[:2], SIZE)
    views = count - 2  # the concatenation takes each image as a view: a view an image, no kernel
    assert operations.count - views == few.count
