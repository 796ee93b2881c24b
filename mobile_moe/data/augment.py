"""Augmentation with torchvision.transforms.v2: the per-image training pipeline and the per-batch MixUp/CutMix.

Targets become probability vectors (B, C) after mixing. Super-class targets are derived from them by one matrix
product with the class -> super-class one-hot matrix (C, E): mixing is linear, so this equals mixing the super-class
one-hots with the same weights and the same partner images, as the paper's loss needs with MixUp/CutMix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads when a pipeline is built: the recipes (and so the CLI's --help) import Augmentation
    from torch import Tensor

    from mobile_moe.data.datasets import Data


# Where a training image is augmented (train --input-pipeline; mobile_moe/data/inputs.py): auto picks crop when the
# recipe augments at random, else workers.
INPUT_PIPELINES = ("auto", "workers", "crop", "device")


MAGNITUDE_BINS = 31  # RandAugment's magnitude bins (torchvision's num_magnitude_bins): magnitudes 0 to 30


@dataclass(frozen=True)
class Augmentation:
    """What a training image goes through (a recipe's augmentation fields: TrainConfig.augmentation), the same for the
    per-image pipeline here and the batched one on the training device (batch_augment.py). No defaults: the recipes
    (mobile_moe/training/recipes.py) own the values."""

    crop_scale: float  # RandomResizedCrop scale range (crop_scale, 1); 1 disables the crop
    hflip: bool
    randaugment_ops: int  # 0 disables RandAugment
    randaugment_magnitude: int  # one of RandAugment's MAGNITUDE_BINS bins, 0 to 30
    mixup_alpha: float  # 0 disables MixUp
    cutmix_alpha: float  # 0 disables CutMix; with both on, one of the two is picked per batch
    random_erasing: float  # probability; 0 disables


def train_transform(cfg: Augmentation, data: Data):
    """Raw image -> augmented, normalised float (3, S, S): crop, flip, RandAugment, normalise, random erasing.

    `crop_scale` 1 keeps the eval geometry (no RandomResizedCrop, whose aspect jitter distorts tiny images).
    """
    from torchvision.transforms import v2

    steps = [v2.ToImage()]
    if cfg.crop_scale < 1:
        steps.append(v2.RandomResizedCrop(data.image_size, scale=(cfg.crop_scale, 1.0), antialias=True))
    else:  # no cropping: the un-augmented geometry (a tiny model on tiny data learns faster without distortion)
        steps.extend(data.resize_for_eval)
    if cfg.hflip:
        steps.append(v2.RandomHorizontalFlip())
    if cfg.randaugment_ops > 0:
        steps.append(v2.RandAugment(num_ops=cfg.randaugment_ops, magnitude=cfg.randaugment_magnitude))
    steps.append(data.normalize())
    if cfg.random_erasing > 0:
        steps.append(v2.RandomErasing(p=cfg.random_erasing, value=0))  # after normalising: erased = the mean pixel
    return v2.Compose(steps)


def draws_at_random(cfg: Augmentation) -> bool:
    """Whether train_transform's pipeline differs from epoch to epoch (crop, flip, RandAugment, erasing); when it
    does not, a run computes its training images once (data.materialized). MixUp and CutMix mix batches later."""
    return cfg.crop_scale < 1 or cfg.hflip or cfg.randaugment_ops > 0 or cfg.random_erasing > 0


def batch_mixer(cfg: Augmentation, num_classes: int):
    """MixUp and/or CutMix on (images, labels) -> (images, soft targets (B, C)); None when both are off."""
    from torchvision.transforms import v2

    mixers = []
    if cfg.mixup_alpha > 0:
        mixers.append(v2.MixUp(alpha=cfg.mixup_alpha, num_classes=num_classes))
    if cfg.cutmix_alpha > 0:
        mixers.append(v2.CutMix(alpha=cfg.cutmix_alpha, num_classes=num_classes))
    if not mixers:
        return None
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)  # DeiT: one of the two per batch, p = 0.5


def class_targets(images: Tensor, labels: Tensor, num_classes: int, mixer=None) -> tuple[Tensor, Tensor]:
    """-> (images, targets (B, C) float): mixed by `mixer` if given, else one-hot labels."""
    import torch.nn.functional as F

    if mixer is not None:
        return mixer(images, labels)
    return images, F.one_hot(labels, num_classes).float()


def assignment_matrix(assignment: list[int], num_super_classes: int, device=None) -> Tensor:
    """(C, E) one-hot: row c has a 1 at super-class assignment[c]."""
    import torch
    import torch.nn.functional as F

    return F.one_hot(torch.as_tensor(assignment, device=device), num_super_classes).float()


def super_targets(targets: Tensor, assignment: Tensor) -> Tensor:
    """Class targets (B, C) -> super-class targets (B, E), mixed exactly as the class targets were."""
    return targets @ assignment  # (B, C) @ (C, E) -> (B, E)
