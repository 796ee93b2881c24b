"""What an export needs from a training run: the model, its metadata, and images from the run's own data.

Parity runs on validation images, int8 calibration on training images, the int8 accuracy check on the validation
split: all through training's seam (`mobile_moe.training.run_dir.load_run`, `Run.open_data`), never by re-reading its
files here.
The eval resize policy the bundle's manifest records is the one those validation images went through: the run's
recorded one (its origin "run").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mobile_moe.training.run_dir import load_run


@dataclass
class ExportSource:
    model: nn.Module
    class_names: list[str]
    super_class_names: list[str] | None
    mean: list[float]
    std: list[float]
    sample_images: Tensor  # (N, C, S, S) normalised: parity
    calibration_images: Tensor | None  # int8 calibration (None: not asked for)
    val_data: tuple[Tensor, Tensor]  # (images, labels): int8 top-1 change
    source: str
    validation_top1: float | None = None  # the run's best validation top-1, recorded in the manifest
    test_top1: float | None = None  # the checkpoint's top-1 on the test split, as `evaluate` gives it
    resize: dict[str, Any] | None = None  # the manifest's input.resize: the eval resize policy and its origin

    def export_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for export.bundle.export_bundle."""
        return {
            "class_names": self.class_names,
            "super_class_names": self.super_class_names,
            "mean": self.mean,
            "std": self.std,
            "sample_images": self.sample_images,
            "calibration_images": self.calibration_images,
            "val_data": self.val_data,
            "source": self.source,
            "validation_top1": self.validation_top1,
            "test_top1": self.test_top1,
            "resize": self.resize,
        }


def _take(dataset, count: int, seed: int) -> tuple[Tensor, Tensor]:
    """`count` items drawn without replacement (seeded), stacked: images (n, C, S, S), labels (n,)."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:count].tolist()
    items = [dataset[i] for i in order]
    return torch.stack([image for image, _ in items]).float(), torch.tensor([label for _, label in items])


def source_from_run(
    run_dir: str | os.PathLike,
    checkpoint: str = "best",
    samples: int = 16,
    calibration: int = 64,
    validation: int = 512,
    data_spec: str | None = None,
) -> ExportSource:
    """The run's model and images from its own data, or from `data_spec` (an imported run has none) with the run's
    preprocessing and classes. `calibration`: training images for int8 calibration (0: none, no train split needed)."""
    run = load_run(run_dir, checkpoint=checkpoint)
    data_config = run.config["data"]
    data = run.open_data(data_spec)  # refuses data with other classes than the run's
    val_images, val_labels = _take(data.split("val"), validation, seed=0)
    calibration_images = _take(data.split("train"), calibration, seed=1)[0] if calibration else None
    super_classes = run.config.get("super_classes")
    if isinstance(super_classes, dict):
        super_classes = super_classes.get("names")
    return ExportSource(
        model=run.model.eval(),
        class_names=list(data_config["class_names"]),
        super_class_names=list(super_classes) if super_classes else None,
        mean=list(data_config["mean"]),
        std=list(data_config["std"]),
        sample_images=val_images[:samples],
        calibration_images=calibration_images,
        val_data=(val_images, val_labels),
        source=str(run.run_dir),
        validation_top1=_best_validation_top1(run.checkpoint),
        test_top1=_test_top1(run.model, data),
        resize=dict(data.eval_resize, origin="run"),
    )


def _test_top1(model: nn.Module, data) -> float | None:
    """The model's top-1 on the data's test split, on the CPU in float32 as `evaluate` computes it by default there;
    None for data without one."""
    from mobile_moe.training.evaluate import evaluate

    if "test" not in data.raw_splits:
        return None
    return evaluate(model, data.split("test"), device="cpu")["top1"]


def _best_validation_top1(checkpoint: dict) -> float | None:
    """best.pt's validation top-1 (checkpoint.pt's best so far), if it holds one: an imported checkpoint may not."""
    value = checkpoint.get("best_top1")
    is_number = isinstance(value, float | int) and not isinstance(value, bool)
    return float(value) if is_number and 0 <= value <= 1 else None
