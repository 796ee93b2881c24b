"""JPEG decoders for an image folder on one CUDA device, the decode alone: torchvision's batched nvJPEG call (what
`--input-pipeline crop` uses from a folder: decode.decode_jpegs) against NVIDIA's nvImageCodec (its batched decoder,
whole images and only the crop's region: ROI decoding), images/s on batches of 256 baseline JPEGs of ImageNet's mix.

    python benchmarks/gpu_decoders.py [--images 2048] [--wheels .whl/optional]

nvImageCodec is no dependency of this project: with --wheels, its wheels (`make gpu-wheels` puts them in
.whl/optional) are unpacked into a temporary directory for this process alone, so a wheel that does not load on the
machine costs this figure, not the GPU machine's torch; the output says why a figure is missing. Each figure includes
the host's work of the call (building the inputs, turning the outputs into torch tensors) and waits for the device.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from input_bench import write_folder  # noqa: E402

from mobile_moe.data import decode  # noqa: E402
from mobile_moe.data.batch_augment import random_resized_crops  # noqa: E402

BATCH = 256


def folder_jpegs(root: Path) -> list[bytes]:
    """The folder's JPEGs that the GPU decodes (decode.device_decodes), as bytes."""
    found = []
    for path in sorted(root.rglob("*")):
        data = path.read_bytes() if path.is_file() else b""
        frame = decode.jpeg_frame(data)
        if frame is not None and decode.device_decodes(frame, data):
            found.append(data)
    return found


def rate(decode_batch, batches: list) -> float:
    """Images/s of `decode_batch` over `batches` after two warm-up batches, the device waited for."""
    for batch in batches[:2]:
        decode_batch(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in batches[2:]:
        decode_batch(batch)
    torch.cuda.synchronize()
    return sum(len(batch) for batch in batches[2:]) / (time.perf_counter() - start)


def torchvision_decoder():
    """torchvision's batched call on pinned host tensors (as crop.on_device gets them from the loader), as the
    pipeline makes it: decode.decode_jpegs, on its own stream, handed to the current one."""
    cuda = torch.device("cuda")
    return lambda pieces: decode.decode_jpegs(pieces, [f"{index}.jpg" for index in range(len(pieces))], cuda)[0]


def pinned(batches: list[list[bytes]]) -> list[list[torch.Tensor]]:
    return [[torch.frombuffer(bytearray(data), dtype=torch.uint8).pin_memory() for data in batch] for batch in batches]


def load_nvimgcodec(wheels: Path, into: Path):
    """nvImageCodec from its wheels in `wheels`, unpacked into `into` for this process (a wheel is a zip; the GPU
    machine's venv has no pip of its own); its nvJPEG loaded first."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise FileNotFoundError(f"no wheels in {wheels}")
    for wheel in found:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(into)
    for library in sorted(into.glob("nvidia/*/lib/libnvjpeg.so*")):
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    sys.path.insert(0, str(into))
    from nvidia import nvimgcodec

    return nvimgcodec


def nvimgcodec_decoder(nvimgcodec, regions: dict[bytes, tuple[int, int, int, int]] | None):
    """nvImageCodec's batched decode; with `regions` (top, left, height, width per image), only each crop's region."""
    decoder = nvimgcodec.Decoder()

    def decode_batch(batch: list[bytes]) -> list[torch.Tensor]:
        streams = [nvimgcodec.CodeStream(data) for data in batch]
        if regions is not None:
            boxes = [regions[data] for data in batch]
            streams = [stream.get_sub_code_stream(region=nvimgcodec.Region(top, left, top + height, left + width))
                       for stream, (top, left, height, width) in zip(streams, boxes, strict=True)]  # fmt: skip
        images = decoder.decode(streams, cuda_stream=torch.cuda.current_stream().cuda_stream)
        if any(image is None for image in images):
            raise RuntimeError(f"{sum(image is None for image in images)} of {len(images)} images refused")
        return [torch.as_tensor(image, device="cuda") for image in images]

    return decode_batch


def crop_regions(jpegs: list[bytes]) -> dict[bytes, tuple[int, int, int, int]]:
    """A RandomResizedCrop box (scale 0.08-1) per image, as the deit recipe draws them."""
    frames = [decode.jpeg_frame(data) for data in jpegs]
    sizes = np.array([(frame.height, frame.width) for frame in frames])
    boxes = random_resized_crops(np.random.default_rng(0), sizes, (0.08, 1.0)).astype(int)
    return {data: tuple(int(v) for v in box) for data, box in zip(jpegs, boxes, strict=True)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2048, help="images written (default 2048)")
    parser.add_argument("--wheels", type=Path, help="nvImageCodec's and nvJPEG's wheels (make gpu-wheels)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("no CUDA device here")
    found: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as scratch:
        jpegs = folder_jpegs(write_folder(Path(scratch) / "folder", args.images, mix="imagenet"))
        batches = [jpegs[start : start + BATCH] for start in range(0, len(jpegs) - BATCH + 1, BATCH)]
        if len(batches) < 3:
            parser.error(f"--images {args.images} makes {len(batches)} batches of {BATCH}: at least 3 are needed")
        found["images timed"] = sum(map(len, batches[2:]))
        found["torchvision decode_jpeg images/s"] = rate(torchvision_decoder(), pinned(batches))
        print(json.dumps(found), flush=True)
        try:
            if args.wheels is None:
                raise RuntimeError("no --wheels")
            nvimgcodec = load_nvimgcodec(args.wheels, Path(scratch) / "nvimgcodec")
            found["nvImageCodec images/s"] = rate(nvimgcodec_decoder(nvimgcodec, None), batches)
            found["nvImageCodec ROI images/s"] = rate(nvimgcodec_decoder(nvimgcodec, crop_regions(jpegs)), batches)
        except Exception as error:  # noqa: BLE001 (any failure of an optional decoder is a figure not measured)
            found["nvImageCodec"] = f"not measured: {type(error).__name__}: {error}"
    print(json.dumps(found), flush=True)
    return found


if __name__ == "__main__":
    main()
