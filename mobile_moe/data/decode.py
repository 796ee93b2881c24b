"""Raw training images for the device pipeline (inputs.py): the DataLoader's workers decode on the CPU only what a GPU
cannot and pad those into one uint8 canvas; on CUDA, baseline colour JPEGs travel as their bytes (one buffer a batch)
and are decoded in one batched nvJPEG call on the GPU (torchvision.io.decode_jpeg with a list and device="cuda",
which runs torch.ops.image.decode_jpegs_cuda: torchvision/io/image.py, decode_jpeg), into the device's canvas.
That call runs without the interpreter lock (torch.ops calls go through invokeOperatorFromPython, which releases it
around the operation: torch/csrc/jit/python/pybind_utils.cpp), so its waits never hold up the step's thread. Its
decoder takes the GPU's hardware JPEG engine where there is one (A100, H100, H200: CUDAJpegDecoder is created with
NVJPEG_BACKEND_HARDWARE, the default backend on NVJPEG_STATUS_ARCH_MISMATCH) for the files nvjpegDecodeBatchedSupported
accepts, in one nvjpegDecodeBatched call, and the others one by one through nvJPEG's host-and-device path
(torchvision/csrc/io/image/cuda/decode_jpegs_cuda.cpp, CUDAJpegDecoder::decode_images).

Which files the GPU takes is read from each JPEG's frame header (its SOF marker: a few bytes, no decoding): 8-bit
baseline or extended-sequential frames of 3 components, stored upright (nvJPEG ignores orientation tags). Progressive,
CMYK, grayscale and sideways JPEGs, PNGs and everything else are decoded in the worker by the one decoder
(mobile_moe.data.image_files), as the folder check decoded them.
torchvision 0.29 deprecates its decoders for TorchCodec's, which neither the pinned stack nor a GPU machine's image
ships; decode_jpeg is called with that warning silenced here, in one place.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import Dataset

from mobile_moe.data.image_files import UnreadableImage, image_from_bytes, stored_upright
from mobile_moe.utils.devices import process_stream

# JPEG start-of-frame markers: 0xC0-0xCF except DHT (C4), JPG (C8) and DAC (CC); the GPU takes C0 and C1
SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
GPU_FRAMES = frozenset({0xC0, 0xC1})
STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})  # markers without a length: TEM, RSTn, SOI


Span = tuple[int, int, int, str]  # a JPEG stored in a batch's blob of bytes: (row of the batch, start, end, name)


@dataclass(frozen=True)
class JpegFrame:
    marker: int
    height: int
    width: int
    components: int
    precision: int  # bits per sample: nvJPEG takes 8
    # an APP1 segment came before the frame: Exif or XMP, from either of which PIL reads an orientation (Pillow's
    # Image.getexif takes XMP's tiff:Orientation where Exif has none), so it may say the image is stored sideways
    app1: bool = False

    @property
    def gpu_decodable(self) -> bool:
        return (self.marker in GPU_FRAMES and self.precision == 8 and self.components == 3 and self.height > 0
                and self.width > 0)  # fmt: skip


def device_decodes(frame: JpegFrame, data: bytes) -> bool:
    """Whether the JPEG `data` (its frame header `frame`) goes to the GPU's decoder: a frame it takes, stored upright
    (nvJPEG ignores orientation tags, Exif's or XMP's: the host decoder turns a sideways photo)."""
    return frame.gpu_decodable and (not frame.app1 or stored_upright(data))


def jpeg_frame(data: bytes) -> JpegFrame | None:
    """The frame header of JPEG `data`; None when it is no JPEG or its header cannot be found before the scan."""
    if data[:2] != b"\xff\xd8":
        return None
    position, app1 = 2, False
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
            height, width = int.from_bytes(header[1:3], "big"), int.from_bytes(header[3:5], "big")
            return JpegFrame(marker, height, width, header[5], header[0], app1)
        if marker == 0xDA or length < 2:  # the scan began without a frame header, or a broken length
            return None
        app1 = app1 or marker == 0xE1
        position += 2 + length
    return None


def uint8_image(image) -> Tensor:
    """A raw image (PIL, or a uint8 tensor (3, h, w) of the in-memory datasets) -> uint8 tensor (3, h, w)."""
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


def source_side_limit(crop_scale: float, image_size: int) -> int:
    """The longest side a training image needs before its crop: the smallest crop RandomResizedCrop draws (a
    crop_scale share of the area) still spans S pixels of it, and never under 2 S. A larger image is shrunk in the
    worker, so one huge photo does not size a batch's canvas (and its float copy) for every image."""
    return max(2 * image_size, math.ceil(image_size / math.sqrt(min(crop_scale, 1.0))))


def fitted(image, max_side: int):
    """A PIL image shrunk (aspect kept, never enlarged; PIL's thumbnail, bicubic) to `max_side`: the one rule for the
    device pipeline's workers and the packed store."""
    if max(image.size) > max_side:
        from PIL import Image

        image = image.copy()
        image.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
    return image


class Fitted:
    """Data.split's transform for the device pipeline where workers decode: a raw image (PIL; an in-memory uint8
    tensor passes as it is) -> uint8 tensor (3, h, w), its longer side at most `max_side`."""

    def __init__(self, max_side: int):
        self.max_side = max_side

    def __call__(self, image) -> Tensor:
        return image if isinstance(image, Tensor) else uint8_image(fitted(image, self.max_side))


class RawImages(Dataset):
    """An encoded split read for the GPU: items (tensor, label, name): a GPU-decodable JPEG's bytes with its name for
    messages, or any other image (and one larger than `max_side`) decoded and fitted here by the one decoder, name
    None."""

    def __init__(self, source, max_side: int):
        self.source, self.targets, self.max_side = source, source.targets, max_side

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, position: int):
        data, label, name = self.source.encoded(position), self.targets[position], self.source.name(position)
        frame = jpeg_frame(data)
        if frame is not None and device_decodes(frame, data) and max(frame.height, frame.width) <= self.max_side:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8), label, (name, frame.height, frame.width)
        return uint8_image(fitted(image_from_bytes(data, name), self.max_side)), label, None


@dataclass
class RawBatch:
    """A batch of raw images. The decoded ones padded into `canvas` (n, 3, H, W) at its top-left, canvas row i being
    image `placed[i]` of the batch; the encoded ones as one buffer `blob` of their bytes one after another (one
    tensor: a worker shares one file with the main process, not one per image), with `encoded` rows (index in the
    batch, start, end, name). `sizes` (B, 2) every image's (height, width), from the JPEG header for encoded ones.
    The host never writes the encoded images' slots: the device fills them."""

    canvas: Tensor  # (n, 3, H, W) uint8
    placed: Tensor  # (n,) int64: each canvas image's row of the batch, pinned with it (no blocking copy to the device)
    sizes: Tensor  # (B, 2) int64
    labels: Tensor  # (B,) int64
    blob: Tensor  # (total bytes,) uint8
    encoded: list[Span]

    def pin_memory(self) -> RawBatch:  # DataLoader(pin_memory=True) calls this on a custom batch type
        return RawBatch(self.canvas.pin_memory(), self.placed.pin_memory(), self.sizes.pin_memory(),
                        self.labels.pin_memory(), self.blob, self.encoded)  # fmt: skip


def collate(items: list[tuple]) -> RawBatch:
    """Items (uint8 image, label), or RawImages' (uint8 image or JPEG bytes, label, (name, h, w) for bytes) ->
    RawBatch, in the worker."""
    sizes, encoded, chunks, placed, offset = [], [], [], [], 0
    for index, (image, _, *bytes_of) in enumerate(items):
        if bytes_of and bytes_of[0] is not None:
            name, height, width = bytes_of[0]
            sizes.append((height, width))
            encoded.append((index, offset, offset + len(image), name))
            chunks.append(image)
            offset += len(image)
        else:
            sizes.append(tuple(image.shape[-2:]))
            placed.append(index)
    height, width = (max(sizes[i][k] for i in placed) for k in (0, 1)) if placed else (0, 0)
    canvas = torch.zeros((len(placed), 3, height, width), dtype=torch.uint8)
    for row, index in enumerate(placed):
        image = items[index][0]
        canvas[row, :, : image.shape[-2], : image.shape[-1]] = image
    labels = torch.tensor([int(item[1]) for item in items])
    blob = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    return RawBatch(canvas, torch.tensor(placed, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int64), labels,
                    blob, encoded)  # fmt: skip


def on_device(batch: RawBatch, device: torch.device) -> tuple[Tensor, Tensor, int]:
    """(canvas (B, 3, H, W) on `device` with every image in its slot, sizes on `device`, files the device refused
    and the host decoded: decode_jpegs)."""
    sizes = batch.sizes.to(device, non_blocking=True)
    decoded = batch.canvas.to(device, non_blocking=True)
    if not batch.encoded:
        return decoded, sizes, 0  # every image decoded in the workers, in batch order
    height, width = (int(v) for v in batch.sizes.max(0).values)
    canvas = torch.zeros((len(batch.sizes), 3, height, width), dtype=torch.uint8, device=device)
    if len(batch.placed):
        rows = batch.placed.to(device, non_blocking=True)
        canvas[:, :, : decoded.shape[-2], : decoded.shape[-1]].index_copy_(0, rows, decoded)
    images, refused = decode_packed(batch.blob, batch.encoded, device)
    for (index, *_), image in zip(batch.encoded, images, strict=True):
        canvas[index, :, : image.shape[-2], : image.shape[-1]] = image
    return canvas, sizes, refused


# torchvision/io/image.py (0.29) `_warn_deprecated` warns on every decode call; one filter for that message, set once
# (warnings.catch_warnings around each call is not thread-safe, and the crop pipeline decodes on a side thread)
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision are deprecated",
                        category=DeprecationWarning)  # fmt: skip


def decode_packed(blob: Tensor, rows: list[Span], device: torch.device) -> tuple[list[Tensor], int]:
    """decode_jpegs of JPEGs stored one after another in `blob`, each row (index in the batch, start, end, name): a
    RawBatch's encoded images, a CroppedBatch's DeviceJpegs."""
    return decode_jpegs([blob[start:end] for _, start, end, _ in rows], [name for *_, name in rows], device)


def decode_jpegs(pieces: list[Tensor], names: list[str], device: torch.device) -> tuple[list[Tensor], int]:
    """JPEG bytes (uint8 tensors on the host) decoded on `device` -> ((3, h, w) uint8 images on `device`, ready on the
    current stream, how many files the device refused). One batched call (on CUDA, nvJPEG's: torchvision/io/image.py
    decode_jpeg with a list runs torch.ops.image.decode_jpegs_cuda); where it raises, which it does for the whole batch
    whatever file it refused, each file alone, and a file the device refuses alone is decoded by the one host decoder,
    which names a damaged file in one line (UnreadableImage).

    On CUDA the images are allocated on a stream of their own. torchvision allocates them on the current stream, then
    writes them from its decoder's private stream, which never waits for the current one (decode_jpegs_cuda.cpp:
    prepare_buffers' torch::empty, then decode_images on CUDAJpegDecoder::stream; its event orders only what comes
    after). The caching allocator hands a block freed on a stream to that stream's next allocation at once, so on the
    current stream nvJPEG could write into the last batch's images while kernels queued there still read them. A
    stream that only these images are allocated on, and record_stream for the stream that reads them, keep a block
    until its readers are done."""
    if device.type != "cuda":
        return _decoded(pieces, names, device)
    reader, writer = torch.cuda.current_stream(device), process_stream(device, "jpeg decode")
    with torch.cuda.stream(writer):
        images, refused = _decoded(pieces, names, device)
    reader.wait_stream(writer)
    for image in images:
        image.record_stream(reader)
    return images, refused


def _decoded(pieces: list[Tensor], names: list[str], device: torch.device) -> tuple[list[Tensor], int]:
    """decode_jpegs on the current stream."""
    from torchvision.io import decode_jpeg

    try:
        return decode_jpeg(pieces, device=device), 0
    except torch.OutOfMemoryError:  # a RuntimeError too, but no refusal: the device is full
        raise
    except RuntimeError:  # a refusal of some file, which the batched call does not name: each file alone, below
        pass
    images, refused = [], 0
    for piece, name in zip(pieces, names, strict=True):
        try:
            images.append(decode_jpeg(piece, device=device))
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            images.append(uint8_image(image_from_bytes(piece.numpy().tobytes(), name)).to(device))
            refused += 1
    return images, refused
