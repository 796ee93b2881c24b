"""The worker half of `train --input-pipeline crop` (FFCV's route; inputs.py): each DataLoader worker decodes a whole
batch, crops (RandomResizedCrop) and flips every image straight to S x S uint8, and hands the main process one
fixed-shape batch with the step's other draws already turned into the device graph's parameters (batch_graph.py).

    sampler = KeyedBatches(DistributedSampler(...), batch_size, seed=S, rank=R)   # [(S, epoch, R, step, index), ...]
    loader = DataLoader(CroppedSplit(raw, aug, data), batch_sampler=sampler, collate_fn=crop.single, ...)

The draws are batch_augment.draw's, keyed by (seed, epoch, rank, step) through the batch sampler's items: the same
batches whatever --workers is, and a resumed run replays them. A JPEG is decoded at the smallest scale at which its
crop still spans S x S pixels (Pillow's `draft`: libjpeg's DCT scaling by 1/2, 1/4 or 1/8, so a 4000 px photo whose
crop is a quarter of it decodes at an eighth of the work), then the crop is resized to S x S by torchvision's
antialiased bilinear resize of uint8 (`resized_crop`). Everything else (PNGs, grey or CMYK JPEGs, sideways photos)
is read by the one decoder (image_files), and the in-memory datasets' uint8 tensors become PIL images as they are;
both take the same resize. PIL's warnings
are kept off stderr once a batch (image_files.pil_quiet), not once an image.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms.v2 import functional as TF

from mobile_moe.data import batch_augment, batch_graph
from mobile_moe.data.augment import Augmentation
from mobile_moe.data.image_files import exif_orientation, image_from_bytes, pil_quiet


class KeyedBatches:
    """A batch sampler over `sampler`'s order: each batch a list of (seed, epoch, rank, step, index), the step's key
    with each image, so the worker that reads it draws from the step's key whichever worker it is. `set_epoch` is the
    sampler's."""

    def __init__(self, sampler, batch_size: int, *, seed: int, rank: int):
        self.sampler, self.batch_size, self.seed, self.rank = sampler, batch_size, seed, rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size  # drop_last

    def __iter__(self):
        order = list(self.sampler)
        for step in range(len(self)):
            chunk = order[step * self.batch_size : (step + 1) * self.batch_size]
            yield [(self.seed, self.epoch, self.rank, step, index) for index in chunk]


@dataclass
class CroppedBatch:
    """One step's images (B, S, S, 3) uint8, cropped and flipped, their labels, and the device graph's parameters."""

    images: Tensor
    labels: Tensor
    params: batch_graph.GraphParams
    key: batch_augment.StepKey

    def pin_memory(self) -> CroppedBatch:  # DataLoader(pin_memory=True) calls this on a custom batch type
        return CroppedBatch(self.images.pin_memory(), self.labels.pin_memory(), self.params.pin_memory(), self.key)


def single(batch: CroppedBatch) -> CroppedBatch:
    """The loader's collate_fn: CroppedSplit.__getitems__ returns the whole batch already."""
    return batch


class CroppedSplit(Dataset):
    """The training split, read a batch at a time (`__getitems__`, which torch's fetcher calls with the batch
    sampler's items) into a CroppedBatch. `raw`: the raw split (items (PIL image or uint8 tensor, label)), read
    through its encoded bytes where it has them (`encoded(i)`, `name(i)`: a store or an image folder)."""

    def __init__(self, raw: Dataset, aug: Augmentation, *, image_size: int, eval_crop):
        self.raw, self.aug, self.image_size, self.eval_crop = raw, aug, image_size, eval_crop

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, index: int):  # the sampler's length and a plain read; training reads __getitems__
        return self.__getitems__([(0, 0, 0, 0, index)])

    def __getitems__(self, items: list[tuple[int, int, int, int, int]]) -> CroppedBatch:
        with pil_quiet():
            return self._batch(items)

    def _batch(self, items: list[tuple[int, int, int, int, int]]) -> CroppedBatch:
        seed, epoch, rank, step, _ = items[0]
        key = batch_augment.StepKey(seed, epoch, rank, step)
        opened = [self._open(index) for *_, index in items]
        sizes = np.array([(image.height, image.width) for image, _, _ in opened], dtype=np.int64)
        eval_crop = self.eval_crop(sizes) if self.aug.crop_scale >= 1 else None  # the eval geometry, when not cropping
        draws = batch_augment.draw(self.aug, sizes, image_size=self.image_size, key=key, eval_crop=eval_crop)
        size = self.image_size
        images = torch.empty((len(items), size, size, 3), dtype=torch.uint8)
        for row, ((image, _, encoded), box, flip) in enumerate(zip(opened, draws.crop, draws.flip, strict=True)):
            cropped = self._cropped(image, box, encoded)
            images[row] = (cropped.flip(-1) if flip else cropped).permute(1, 2, 0)
        labels = torch.tensor([label for _, label, _ in opened], dtype=torch.int64)
        return CroppedBatch(images, labels, batch_graph.params(draws, size), key)

    def _open(self, index: int) -> tuple[Image.Image, int, tuple[bytes, str] | None]:
        """(image `index`, its label, and for a JPEG not decoded yet, whose crop decodes at reduced scale, its bytes
        and name)."""
        if hasattr(self.raw, "encoded"):
            data, name = self.raw.encoded(index), self.raw.name(index)
            label = int(self.raw.targets[index])
            lazy = lazy_jpeg(data)
            return (lazy, label, (data, name)) if lazy is not None else (image_from_bytes(data, name), label, None)
        image, label = self.raw[index]
        if isinstance(image, Tensor):  # the in-memory datasets: (3, h, w) uint8
            image = Image.fromarray(image.permute(1, 2, 0).numpy())
        return image.convert("RGB"), int(label), None

    def _cropped(self, image: Image.Image, box: np.ndarray, encoded: tuple[bytes, str] | None) -> Tensor:
        """resized_crop; a JPEG whose header read well but whose data does not decode is read again by the one
        decoder, which names it in one line (UnreadableImage) or, where PIL reads what it can, decodes it whole."""
        if encoded is None:
            return resized_crop(image, box, self.image_size, lazy=False)
        try:
            return resized_crop(image, box, self.image_size, lazy=True)
        except (OSError, SyntaxError, ValueError):
            return resized_crop(image_from_bytes(*encoded), box, self.image_size, lazy=False)


def lazy_jpeg(data: bytes) -> Image.Image | None:
    """An RGB baseline or progressive JPEG stored upright, opened but not decoded (so `draft` can scale its decode);
    None for anything else, which the one decoder reads."""
    try:
        image = Image.open(io.BytesIO(data))
        if image.format == "JPEG" and image.mode == "RGB" and exif_orientation(image) == 1:
            return image
    except Exception:  # noqa: BLE001 (any failure: the decoder, which reports it in one line, decides)
        return None
    return None


def resized_crop(image: Image.Image, box: np.ndarray, size: int, *, lazy: bool) -> Tensor:
    """The crop (top, left, height, width in the image's pixels) resized to size x size, antialiased bilinear: (3, S,
    S) uint8. A lazy JPEG (not decoded yet) is decoded at the smallest DCT scale at which the crop keeps `size` pixels
    a side. The resize is torchvision's resize_image on uint8, whose channels-last AVX2 kernel (ATen
    UpSampleKernel.cpp, after Pillow-SIMD) costs a fifth of Pillow's resize, and equals it but for a level on a few
    values in a thousand."""
    top, left, height, width = (float(v) for v in box)
    full_width, full_height = image.size
    if lazy:  # draft scales image.size with the decode it chose
        image.draft("RGB", (math.ceil(full_width * size / width), math.ceil(full_height * size / height)))
    scale_x, scale_y = image.width / full_width, image.height / full_height
    region = (left * scale_x, top * scale_y, (left + width) * scale_x, (top + height) * scale_y)
    # cropped first, as torchvision's resized_crop. Whole pixels (the random crops' already are; an eval crop's or a
    # draft's are not), never an empty box
    left, top = (min(math.floor(v), limit - 1) for v, limit in zip(region[:2], image.size, strict=True))
    right, bottom = (max(math.ceil(v), low + 1) for v, low in zip(region[2:], (left, top), strict=True))
    pixels = torch.from_numpy(np.array(image.crop((left, top, right, bottom)))).permute(2, 0, 1)
    return TF.resize_image(pixels, [size, size], interpolation=TF.InterpolationMode.BILINEAR, antialias=True)
