"""Image files -> the tensor a bundle takes, with the bundle's own preprocessing (resize to S, scale, mean/std)."""

from __future__ import annotations

import os
from typing import Any

import torch

from mobile_moe.errors import UsageError


def preprocess(manifest_input: dict[str, Any]):
    from torchvision.transforms import v2

    _, _, height, width = manifest_input["shape"]
    return v2.Compose(
        [
            v2.ToImage(),
            v2.Resize((height, width), antialias=True),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(manifest_input["mean"], manifest_input["std"]),
        ]
    )


def load_image(path: str | os.PathLike, manifest_input: dict[str, Any]) -> torch.Tensor:
    """(C, S, S) float32 for the PNG/JPEG at `path`; UsageError if it cannot be read as an image."""
    from PIL import Image, UnidentifiedImageError

    channels = manifest_input["shape"][1]
    if not os.path.exists(path):
        raise UsageError(f"image {path} does not exist")
    if not os.path.isfile(path):  # a directory, a FIFO (opening it would wait forever) or a device
        raise UsageError(f"image {path} is not a regular file; pass PNG or JPEG files")
    try:
        with Image.open(path) as image:
            image = image.convert("RGB" if channels == 3 else "L")
    except Image.DecompressionBombError as error:
        raise UsageError(f"{path} is too large to decode safely ({error}); resize it first") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:  # PIL raises SyntaxError on bad PNGs
        raise UsageError(f"cannot read {path} as an image (PNG or JPEG expected): {error}") from None
    return preprocess(manifest_input)(image).contiguous()
