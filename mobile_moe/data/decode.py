"""Raw training images for the device pipeline (inputs.py): the DataLoader's workers decode on the CPU only what a GPU
cannot, and pad a batch into one uint8 canvas; on CUDA, baseline colour JPEGs travel as their bytes and are decoded
in one batched nvJPEG call on the GPU (torchvision.io.decode_jpeg with a list and device="cuda", which runs
torch.ops.image.decode_jpegs_cuda: torchvision/io/image.py, decode_jpeg).

Which files the GPU takes is read from each JPEG's frame header (its SOF marker: a few bytes, no decoding): baseline or
extended-sequential frames of 3 components. Progressive, CMYK and grayscale JPEGs, PNGs and everything else are
decoded in the worker by the one decoder, mobile_moe.data.image_files.read_image (PIL), as the folder check decoded
them. torchvision 0.29 deprecates its decoders for TorchCodec's, which neither the pinned stack nor a GPU machine's
image ships; decode_jpeg is called with that warning silenced here, in one place.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import Dataset

from mobile_moe.data.image_files import UnreadableImage, image_from_bytes

# JPEG start-of-frame markers: 0xC0-0xCF except DHT (C4), JPG (C8) and DAC (CC); the GPU takes C0 and C1
SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
GPU_FRAMES = frozenset({0xC0, 0xC1})
STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})  # markers without a length: TEM, RSTn, SOI


@dataclass(frozen=True)
class JpegFrame:
    marker: int
    height: int
    width: int
    components: int

    @property
    def gpu_decodable(self) -> bool:
        return self.marker in GPU_FRAMES and self.components == 3 and self.height > 0 and self.width > 0


def jpeg_frame(data: bytes) -> JpegFrame | None:
    """The frame header of JPEG `data`; None when it is no JPEG or its header cannot be found before the scan."""
    if data[:2] != b"\xff\xd8":
        return None
    position = 2
    while position + 4 <= len(data):
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte
            position += 1
            continue
        if marker in STANDALONE:
            position += 2
            continue
        length = int.from_bytes(data[position + 2 : position + 4], "big")
        if marker in SOF_MARKERS:
            header = data[position + 4 : position + 10]
            if len(header) < 6:
                return None
            return JpegFrame(marker, int.from_bytes(header[1:3], "big"), int.from_bytes(header[3:5], "big"), header[5])
        if marker == 0xDA or length < 2:  # the scan began without a frame header, or a broken length
            return None
        position += 2 + length
    return None


def uint8_image(image) -> Tensor:
    """A raw image (PIL, or a uint8 tensor (3, h, w) of the in-memory datasets) -> uint8 tensor (3, h, w): Data.split's
    transform for the device pipeline."""
    if isinstance(image, Tensor):
        return image
    from torchvision.transforms.v2 import functional as F

    return F.pil_to_tensor(image)


class FolderFiles:
    """An image folder's split (an ImageFolder, or a Subset of one) as encoded images: `encoded(i)`, `name(i)`."""

    def __init__(self, samples: list[tuple[str, int]]):
        self.samples = samples
        self.targets = [label for _, label in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def name(self, position: int) -> str:
        return f"image {self.samples[position][0]}"

    def encoded(self, position: int) -> bytes:
        path = self.samples[position][0]
        try:
            with open(path, "rb") as file:
                return file.read()
        except OSError as error:
            raise UnreadableImage(f"cannot read image {path}: {error.strerror or error}") from None


def encoded_split(raw: Dataset):
    """`raw` as encoded images (FolderFiles, or a packed store's StoreSplit as it is); None for in-memory data."""
    if hasattr(raw, "encoded"):
        return raw
    indices = getattr(raw, "indices", None)
    folder = raw.dataset if indices is not None else raw
    samples = getattr(folder, "samples", None)
    if samples is None:
        return None
    return FolderFiles([samples[int(i)] for i in indices] if indices is not None else list(samples))


class RawImages(Dataset):
    """An encoded split read for the GPU: items (tensor, label, encoded): a GPU-decodable JPEG's bytes, or any other
    image decoded here by the one decoder."""

    def __init__(self, source):
        self.source, self.targets = source, source.targets

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, position: int):
        data, label = self.source.encoded(position), self.targets[position]
        frame = jpeg_frame(data)
        if frame is not None and frame.gpu_decodable:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8), label, True
        return uint8_image(image_from_bytes(data, self.source.name(position))), label, False


@dataclass
class RawBatch:
    """A batch of raw images: decoded ones padded into `canvas` at its top-left, encoded ones (their slots left zero)
    kept as bytes; `sizes` (B, 2) every image's (height, width), read from the JPEG header for encoded ones."""

    canvas: Tensor  # (B, 3, H, W) uint8
    sizes: Tensor  # (B, 2) int64
    labels: Tensor  # (B,) int64
    encoded: list[tuple[int, Tensor]]  # (index in the batch, JPEG bytes)

    def pin_memory(self) -> RawBatch:  # DataLoader(pin_memory=True) calls this on a custom batch type
        return RawBatch(self.canvas.pin_memory(), self.sizes, self.labels.pin_memory(), self.encoded)


def collate(items: list[tuple]) -> RawBatch:
    """Items (uint8 image or JPEG bytes, label[, encoded]) -> RawBatch, in the worker."""
    sizes, encoded = [], []
    for index, (image, _, *flag) in enumerate(items):
        if flag and flag[0]:
            frame = jpeg_frame(image.numpy().tobytes())
            sizes.append((frame.height, frame.width))
            encoded.append((index, image))
        else:
            sizes.append(tuple(image.shape[-2:]))
    height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
    canvas = torch.zeros((len(items), 3, height, width), dtype=torch.uint8)
    coded = {index for index, _ in encoded}
    for index, (image, *_) in enumerate(items):
        if index not in coded:
            canvas[index, :, : image.shape[-2], : image.shape[-1]] = image
    labels = torch.tensor([int(item[1]) for item in items])
    return RawBatch(canvas, torch.tensor(sizes, dtype=torch.int64), labels, encoded)


def on_device(batch: RawBatch, device: torch.device) -> tuple[Tensor, Tensor]:
    """(canvas on `device` with every encoded image decoded into its slot, sizes on `device`)."""
    canvas = batch.canvas.to(device, non_blocking=True)
    if batch.encoded:
        from torchvision.io import decode_jpeg

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # see the module docstring
            decoded = decode_jpeg([data for _, data in batch.encoded], device=device)
        for (index, _), image in zip(batch.encoded, decoded, strict=True):
            canvas[index, :, : image.shape[-2], : image.shape[-1]] = image
    return canvas, batch.sizes.to(device, non_blocking=True)
