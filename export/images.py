"""Image files -> the tensor a bundle takes, with the bundle's own preprocessing: its manifest's input.resize policy,
then scale and mean/std, through mobile_moe.preprocess, the transform training's evaluation uses too."""

from __future__ import annotations

import os
from typing import Any

import torch

from mobile_moe.errors import UsageError


def preprocess(manifest_input: dict[str, Any]):
    """PIL image -> (C, S, S) float32, as evaluation transformed the run's validation images (a validated manifest)."""
    from mobile_moe import preprocess as eval_pipeline

    size = manifest_input["shape"][-1]
    resize = manifest_input.get("resize") or eval_pipeline.stretch()  # a bundle from before the record: stretch
    return eval_pipeline.eval_transform(resize, size, manifest_input["mean"], manifest_input["std"])


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
