"""Image files -> the tensor a bundle takes, with the bundle's own preprocessing: its manifest's input.resize policy,
then scale and mean/std, through mobile_moe.preprocess, the transform training's evaluation uses too."""

from __future__ import annotations

import os

import torch

from mobile_moe import preprocess as eval_pipeline
from mobile_moe.data.image_files import read_image
from mobile_moe.export.manifest_schema import InputSpec


def preprocess(manifest_input: InputSpec):
    """PIL image -> (C, S, S) float32, as evaluation transformed the run's validation images."""
    resize = manifest_input.resize.model_dump(exclude_none=True)
    size = manifest_input.shape[-1]
    return eval_pipeline.eval_transform(resize, size, manifest_input.mean, manifest_input.std)


def load_image(path: str | os.PathLike, manifest_input: InputSpec) -> torch.Tensor:
    """(C, S, S) float32 for the PNG/JPEG at `path`; UnreadableImage (a UsageError) if it cannot be read as one."""
    image = read_image(path, "RGB" if manifest_input.shape[1] == 3 else "L")
    return preprocess(manifest_input)(image).contiguous()
