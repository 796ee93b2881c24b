"""Image files -> the tensor a bundle takes, with the bundle's own preprocessing: its manifest's input.resize policy,
then scale and mean/std, through mobile_moe.preprocess, the transform training's evaluation uses too."""

from __future__ import annotations

import os
from typing import Any

import torch

from mobile_moe.image_files import read_image


def preprocess(manifest_input: dict[str, Any]):
    """PIL image -> (C, S, S) float32, as evaluation transformed the run's validation images (a validated manifest)."""
    from mobile_moe import preprocess as eval_pipeline

    size = manifest_input["shape"][-1]
    resize = manifest_input.get("resize") or eval_pipeline.stretch()  # a bundle from before the record: stretch
    return eval_pipeline.eval_transform(resize, size, manifest_input["mean"], manifest_input["std"])


def load_image(path: str | os.PathLike, manifest_input: dict[str, Any]) -> torch.Tensor:
    """(C, S, S) float32 for the PNG/JPEG at `path`; UnreadableImage (a UsageError) if it cannot be read as one."""
    image = read_image(path, "RGB" if manifest_input["shape"][1] == 3 else "L")
    return preprocess(manifest_input)(image).contiguous()
