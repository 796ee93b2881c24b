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
both take the same resize. PIL's warnings are kept off stderr once a batch (image_files.pil_quiet), not once an image.

From an image folder on CUDA (inputs.decodes_jpegs_on_device), the JPEGs the GPU decodes travel as their bytes
instead, with their crops and flips, and `on_device` decodes, crops and flips them on the device, in the rows the
worker left.
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

from mobile_moe.data import batch_augment, batch_graph, decode
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
class DeviceJpegs:
    """A batch's JPEGs left to the training device's decoder (CroppedSplit(device_jpegs=True)): their bytes one after
    another (one tensor: a worker shares one file with the main process, not one per image), each (row of the batch,
    start, end, name), its (height, width) read from its header, and the crop and flip drawn for each: the crop also
    as the whole pixels it covers in an image of that size (pixel_box, computed here in the worker), the flips and rows
    as tensors the loader pins, so the device takes them without a blocking copy."""

    blob: Tensor  # (total bytes,) uint8
    rows: list[decode.Span]
    sizes: list[tuple[int, int]]
    boxes: np.ndarray  # (n, 4) top, left, height, width
    pixels: list[tuple[int, int, int, int]]  # (left, top, right, bottom)
    flips: Tensor  # (n,) bool
    index: Tensor  # (n,) int64: each JPEG's row of the batch

    def pin_memory(self) -> DeviceJpegs:
        return DeviceJpegs(self.blob.pin_memory(), self.rows, self.sizes, self.boxes, self.pixels,
                           self.flips.pin_memory(), self.index.pin_memory())  # fmt: skip


@dataclass
class CroppedBatch:
    """One step's images (B, S, S, 3) uint8, cropped and flipped, their labels, and the device graph's parameters;
    with `jpegs`, the rows they name are left for the device to decode and crop (on_device)."""

    images: Tensor
    labels: Tensor
    params: batch_graph.GraphParams
    key: batch_augment.StepKey
    jpegs: DeviceJpegs | None = None

    def pin_memory(self) -> CroppedBatch:  # DataLoader(pin_memory=True) calls this on a custom batch type
        return CroppedBatch(self.images.pin_memory(), self.labels.pin_memory(), self.params.pin_memory(), self.key,
                            self.jpegs and self.jpegs.pin_memory())  # fmt: skip


def single(batch: CroppedBatch) -> CroppedBatch:
    """The loader's collate_fn: CroppedSplit.__getitems__ returns the whole batch already."""
    return batch


class CroppedSplit(Dataset):
    """The training split, read a batch at a time (`__getitems__`, which torch's fetcher calls with the batch
    sampler's items) into a CroppedBatch. `raw`: the raw split (items (PIL image or uint8 tensor, label)), read
    through its encoded bytes where it has them (`encoded(i)`, `name(i)`: a store or an image folder). With
    `device_jpegs`, the JPEGs a GPU decodes (decode.device_decodes) travel as bytes, sized from their headers, where
    their longer side is within decode.source_side_limit (the largest a crop needs whole)."""

    def __init__(self, raw: Dataset, aug: Augmentation, *, image_size: int, eval_crop, device_jpegs: bool = False):
        self.raw, self.aug, self.image_size, self.eval_crop = raw, aug, image_size, eval_crop
        self.device_jpegs = device_jpegs

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
        sizes = np.array([item.size for item in opened], dtype=np.int64)
        eval_crop = self.eval_crop(sizes) if self.aug.crop_scale >= 1 else None  # the eval geometry, when not cropping
        draws = batch_augment.draw(self.aug, sizes, image_size=self.image_size, key=key, eval_crop=eval_crop)
        size = self.image_size
        images = torch.empty((len(items), size, size, 3), dtype=torch.uint8)
        for_device = []  # rows whose JPEG the device decodes
        for row, (item, box, flip) in enumerate(zip(opened, draws.crop, draws.flip, strict=True)):
            if item.image is None:
                for_device.append(row)
                continue
            cropped = self._cropped(item.image, box, item.encoded)
            images[row] = (cropped.flip(-1) if flip else cropped).permute(1, 2, 0)
        labels = torch.tensor([item.label for item in opened], dtype=torch.int64)
        jpegs = None
        if for_device:
            jpegs = device_jpegs([opened[row].encoded for row in for_device], for_device, sizes, draws)
        return CroppedBatch(images, labels, batch_graph.params(draws, size), key, jpegs)

    def _open(self, index: int) -> Opened:
        """Image `index` with its label; for a JPEG not decoded yet (its crop decodes at reduced scale, or the device
        decodes it), its bytes and name."""
        if hasattr(self.raw, "encoded"):
            # a larger photo is decoded here at reduced scale (draft): on the device it would decode whole, and a
            # downscale past ~90x overflows the CUDA antialiased resize's shared memory
            limit = decode.source_side_limit(self.aug.crop_scale, self.image_size)
            data, name = self.raw.encoded(index), self.raw.name(index)
            label = int(self.raw.targets[index])
            frame = decode.jpeg_frame(data) if self.device_jpegs else None
            if frame is not None and decode.device_decodes(frame, data) and max(frame.height, frame.width) <= limit:
                return Opened(None, label, (data, name), (frame.height, frame.width))
            lazy = lazy_jpeg(data)
            image = lazy if lazy is not None else image_from_bytes(data, name)
            return Opened(image, label, (data, name) if lazy is not None else None, (image.height, image.width))
        image, label = self.raw[index]
        if isinstance(image, Tensor):  # the in-memory datasets: (3, h, w) uint8
            image = Image.fromarray(image.permute(1, 2, 0).numpy())
        image = image.convert("RGB")
        return Opened(image, int(label), None, (image.height, image.width))

    def _cropped(self, image: Image.Image, box: np.ndarray, encoded: tuple[bytes, str] | None) -> Tensor:
        """resized_crop; a JPEG whose header read well but whose data does not decode is read again by the one
        decoder, which names it in one line (UnreadableImage) or, where PIL reads what it can, decodes it whole."""
        if encoded is None:
            return resized_crop(image, box, self.image_size, lazy=False)
        try:
            return resized_crop(image, box, self.image_size, lazy=True)
        except (OSError, SyntaxError, ValueError):
            return resized_crop(image_from_bytes(*encoded), box, self.image_size, lazy=False)


@dataclass
class Opened:
    """An image as the worker opened it: `image` None where the device decodes it, `encoded` (bytes, name) where it
    is a JPEG not decoded yet, `size` (height, width)."""

    image: Image.Image | None
    label: int
    encoded: tuple[bytes, str] | None
    size: tuple[int, int]


def device_jpegs(encoded: list[tuple[bytes, str]], rows: list[int], sizes: np.ndarray, draws: batch_augment.Draws
                 ) -> DeviceJpegs:  # fmt: skip
    """The JPEGs (bytes, name) of batch rows `rows`, with those rows' crops and flips; `sizes` (B, 2) the batch's
    (height, width), from the JPEGs' headers."""
    spans, end = [], 0
    for row, (data, name) in zip(rows, encoded, strict=True):
        spans.append((row, end, end + len(data), name))
        end += len(data)
    blob = torch.frombuffer(bytearray(b"".join(data for data, _ in encoded)), dtype=torch.uint8)
    heights_widths = [(int(sizes[row, 0]), int(sizes[row, 1])) for row in rows]
    pixels = [pixel_box(draws.crop[row], (width, height))
              for row, (height, width) in zip(rows, heights_widths, strict=True)]  # fmt: skip
    return DeviceJpegs(blob, spans, heights_widths, draws.crop[rows], pixels, torch.from_numpy(draws.flip[rows]),
                       torch.tensor(rows, dtype=torch.int64))  # fmt: skip


def on_device(batch: CroppedBatch, device: torch.device) -> tuple[Tensor, int]:
    """The batch's images (B, S, S, 3) uint8 on `device`, its JPEGs left to the device decoded (decode.decode_packed),
    cropped, resized and flipped there as a worker would have (resized_crop's box and resize); -> (images, files the
    device refused and the host decoded)."""
    images = batch.images.to(device, non_blocking=True)
    if batch.jpegs is None:
        return images, 0
    jpegs = batch.jpegs
    decoded, refused = decode.decode_packed(jpegs.blob, jpegs.rows, device)
    pixels = jpegs.pixels
    if [tuple(image.shape[1:]) for image in decoded] != jpegs.sizes:  # a decode of another size than its header's
        pixels = [pixel_box(box, (image.shape[2], image.shape[1]))
                  for image, box in zip(decoded, jpegs.boxes, strict=True)]  # fmt: skip
    cropped = squares(decoded, pixels, images.shape[1])
    flips = jpegs.flips.to(device, non_blocking=True)[:, None, None, None]
    cropped = torch.where(flips, cropped.flip(-1), cropped)
    images.index_copy_(0, jpegs.index.to(device, non_blocking=True), cropped.permute(0, 2, 3, 1))
    return images, refused


def squares(images: list[Tensor], pixels: list[tuple[int, int, int, int]], size: int) -> Tensor:
    """Each (3, h, w) uint8 image's crop (left, top, right, bottom) resized to S x S by the antialiased bilinear filter,
    into one (n, 3, S, S) uint8 batch. Off a CPU all at once (batched_squares: a constant number of operations a
    batch, where a loop over the images cost the thread preparing a folder's batches 40-44 ms of host time a batch of
    256 on an H200, more than the step). On a CPU (the tests' device: a CPU never decodes for training) each crop is
    `square`'s, whose uint8 or float path torchvision picks by the CPU's features."""
    if not images or images[0].device.type == "cpu":
        return torch.stack([square(image[:, top:bottom, left:right], size)
                            for image, (left, top, right, bottom) in zip(images, pixels, strict=True)])  # fmt: skip
    return batched_squares(images, pixels, size)


def batched_squares(images: list[Tensor], pixels: list[tuple[int, int, int, int]], size: int) -> Tensor:
    """squares' crops resized together: the images' bytes concatenated once, then the antialiased filter's taps
    gathered for the whole batch, one tap at a time, rows then columns (the filter is separable): 2 K + a few
    operations a batch, K the most taps any crop's scale needs (2 ceil(crop side / S) + 1; a device's images are at
    most decode.source_side_limit a side, 9 taps for the deit recipe at 224 px). The filter is ATen's (and Pillow's)
    for an antialiased bilinear resize (aa_taps), in float32 as torch's CUDA kernel computes it, summed in another
    order: a level apart from it on a few values (tests/data/test_crop_batched.py holds it to one)."""
    device = images[0].device
    flat = torch.cat([image.reshape(-1) for image in images])
    heights, widths = (torch.tensor([image.shape[axis] for image in images], device=device) for axis in (1, 2))
    boxes = torch.tensor(pixels, dtype=torch.int64, device=device)  # left, top, right, bottom
    lefts, tops, crop_w, crop_h = boxes[:, 0], boxes[:, 1], boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    starts = torch.cumsum(torch.tensor([0] + [image.numel() for image in images[:-1]], device=device), 0)
    widest = max(right - left for left, _, right, _ in pixels)  # from the host's boxes: no read of the device
    taps = 2 * math.ceil(max(max(right - left, bottom - top) for left, top, right, bottom in pixels) / size) + 1
    rows, row_weights = aa_taps(crop_h, size, taps)  # (n, S, K) each, rows of the crop
    cols, col_weights = aa_taps(crop_w, size, taps)
    columns = torch.minimum(torch.arange(widest, device=device), crop_w[:, None] - 1) + lefts[:, None]  # (n, W)
    planes = torch.arange(3, device=device)[None, :, None, None] * (heights * widths)[:, None, None, None]
    base = starts[:, None, None, None] + planes + columns[:, None, None, :]  # (n, 3, 1, W)
    tall = torch.zeros((len(images), 3, size, widest), device=device)
    for k in range(taps):  # rows: each output row from its K source rows, every column of the crop
        at = base + ((tops[:, None] + rows[:, :, k]) * widths[:, None])[:, None, :, None]
        tall += flat[at].float() * row_weights[:, None, :, k, None]
    out = torch.zeros((len(images), 3, size, size), device=device)
    for k in range(taps):  # then columns
        out += tall.gather(3, cols[:, None, None, :, k].expand(-1, 3, size, -1)) * col_weights[:, None, None, :, k]
    return out.round_().clamp_(0, 255).to(torch.uint8)


def aa_taps(extent: Tensor, size: int, taps: int) -> tuple[Tensor, Tensor]:
    """For crops of `extent` (n,) pixels on one axis resized to `size`: each output pixel's first `taps` source pixels
    (n, S, taps), clamped inside the crop, and their weights (n, S, taps), zero past the filter's support. The
    antialiased bilinear filter of ATen's _upsample_bilinear2d_aa (UpSampleKernel.cpp _compute_weights_aa, as
    Pillow's): scale = extent / S; support = scale (1 when enlarging); output i centred at scale (i + 0.5); its
    sources from trunc(centre - support + 0.5) (at least 0) to trunc(centre + support + 0.5) (at most the extent),
    each weighted by the triangle 1 - |(j - centre + 0.5) / max(scale, 1)|, normalised to sum to 1."""
    scale = extent.float()[:, None] / size  # (n, 1)
    support = scale.clamp(min=1.0)
    centre = scale * (torch.arange(size, device=extent.device, dtype=torch.float32) + 0.5)  # (n, S)
    first = (centre - support + 0.5).to(torch.int64).clamp(min=0)
    last = torch.minimum((centre + support + 0.5).to(torch.int64), extent[:, None])
    sources = first[..., None] + torch.arange(taps, device=extent.device)  # (n, S, K)
    weights = (1 - ((sources - centre[..., None] + 0.5) / support[..., None]).abs()).clamp(min=0)
    weights = torch.where(sources < last[..., None], weights, 0.0)
    weights = weights / weights.sum(-1, keepdim=True)
    return torch.minimum(sources, extent[:, None, None] - 1), weights


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
    """The crop (top, left, height, width in the image's pixels) resized to size x size (`square`): (3, S, S) uint8.
    A lazy JPEG (not decoded yet) is decoded at the smallest DCT scale at which the crop keeps `size` pixels a side."""
    top, left, height, width = (float(v) for v in box)
    full_width, full_height = image.size
    if lazy:  # draft scales image.size with the decode it chose
        image.draft("RGB", (math.ceil(full_width * size / width), math.ceil(full_height * size / height)))
    # cropped first, as torchvision's resized_crop
    region = image.crop(pixel_box(box, image.size, (image.width / full_width, image.height / full_height)))
    return square(torch.from_numpy(np.array(region)).permute(2, 0, 1), size)


def pixel_box(box: np.ndarray, size: tuple[int, int], scale: tuple[float, float] = (1.0, 1.0)):
    """(left, top, right, bottom): the whole pixels of an image of `size` (width, height) that a crop box (top, left,
    height, width) covers, the box given at the image's `scale` (x, y) times its size (a draft's decode): a random
    crop's box is whole pixels already, an eval crop's or a draft's is not; never empty."""
    top, left, height, width = (float(v) for v in box)
    scale_x, scale_y = scale
    region = (left * scale_x, top * scale_y, (left + width) * scale_x, (top + height) * scale_y)
    left, top = (min(math.floor(v), limit - 1) for v, limit in zip(region[:2], size, strict=True))
    # a draft's scale is no exact binary fraction: an edge's ceil can land a pixel past the image (PIL fills it black)
    right, bottom = (max(min(math.ceil(v), limit), low + 1) for v, limit, low in zip(region[2:], size, (left, top),
                                                                                     strict=True))  # fmt: skip
    return left, top, right, bottom


def square(pixels: Tensor, size: int) -> Tensor:
    """(3, h, w) uint8 -> (3, S, S) uint8 by torchvision's antialiased bilinear resize_image: on a CPU its channels-last
    uint8 AVX2 kernel (ATen UpSampleKernel.cpp, after Pillow-SIMD), a fifth of Pillow's resize and equal to it but for
    a level on a few values in a thousand; on CUDA in float32, rounded."""
    return TF.resize_image(pixels, [size, size], interpolation=TF.InterpolationMode.BILINEAR, antialias=True)
