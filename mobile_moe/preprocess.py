"""How an image becomes the (C, S, S) float tensor a model is evaluated on: the eval resize policy, then scaling to
[0, 1] and the mean/std normalisation. ONE definition for training's evaluation pipeline (mobile_moe/data/datasets.py)
and export's predict (mobile_moe/export/images.py): a run's config.json records its policy (`data.eval_resize`) and a
bundle's manifest carries it on (`input.resize`), so predict feeds a bundle an image file exactly as evaluation fed the
model.

Resize policies (the record's `policy`):

    stretch              both sides to S, the aspect ratio not kept (nothing changes for an image already S x S):
                         {"policy": "stretch"}
    resize-center-crop   the shorter side to `resize_to` (aspect ratio kept), then the centre `crop_to` x `crop_to`
                         square (crop_to = S); ImageNet-style evaluation has resize_to = round(S * 256 / 224):
                         {"policy": "resize-center-crop", "resize_to": 37, "crop_to": 32}

Either policy may name its `interpolation`: "bilinear" (absent: the default) or "bicubic" (timm's ViTs and DeiTs).

A record is strict: an unknown policy, key or interpolation, a size that is not a positive integer, resize_to <
crop_to and (where S is known) crop_to != S are refused, because any of them would change the pixels a model sees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mobile_moe.errors import UsageError

STRETCH = "stretch"
RESIZE_CENTER_CROP = "resize-center-crop"
POLICIES = (STRETCH, RESIZE_CENTER_CROP)
INTERPOLATIONS = ("bilinear", "bicubic")
CROP_RATIO = 256 / 224  # ImageNet evaluation: resize the shorter side to 256, crop 224
MAX_SIDE = 1 << 16  # the manifest schema's MAX_DIM

Side = Annotated[int, Field(ge=1, le=MAX_SIDE)]


class ResizePolicy(BaseModel):
    """A resize policy record (see the module docstring); the manifest schema's `input.resize` extends it."""

    # strict: 37.0, "37" and true are not sizes; forbid: a key we do not know might change the pixels.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    policy: Literal[POLICIES]  # type: ignore[valid-type]
    resize_to: Side | None = None
    crop_to: Side | None = None
    interpolation: Literal[INTERPOLATIONS] | None = None  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _sizes_fit_the_policy(self) -> ResizePolicy:
        if self.policy == STRETCH and (self.resize_to is not None or self.crop_to is not None):
            raise ValueError("the stretch policy resizes to the input size and takes no resize_to or crop_to")
        if self.policy == RESIZE_CENTER_CROP:
            if self.resize_to is None or self.crop_to is None:
                raise ValueError("the resize-center-crop policy needs resize_to and crop_to")
            if self.resize_to < self.crop_to:
                raise ValueError(
                    f"resize_to {self.resize_to} is smaller than crop_to {self.crop_to}: the crop must fit in"
                )
        return self


def stretch() -> dict[str, Any]:
    return {"policy": STRETCH}


def resize_center_crop(
    image_size: int, resize_to: int | None = None, interpolation: str | None = None
) -> dict[str, Any]:
    """Shorter side to `resize_to` (default: ImageNet's round(S * 256 / 224)), then the centre S x S."""
    record = {"policy": RESIZE_CENTER_CROP, "resize_to": resize_to or int(round(image_size * CROP_RATIO))}
    record["crop_to"] = image_size
    return record if interpolation in (None, "bilinear") else {**record, "interpolation": interpolation}


def check_resize(record: Any, image_size: int, where: str) -> dict[str, Any]:
    """`record` as a plain dict if it is a valid policy for S = `image_size`; else a one-line UsageError naming
    `where` the record came from."""
    try:
        policy = ResizePolicy.model_validate(record)
    except ValidationError as error:
        first = error.errors(include_url=False, include_input=False)[0]
        field = ".".join(str(part) for part in first["loc"])
        problem = first["msg"].removeprefix("Value error, ")
        raise UsageError(f"{where}: {field + ': ' if field else ''}{problem} (see mobile_moe/preprocess.py)") from None
    if policy.crop_to not in (None, image_size):
        raise UsageError(f"{where}: crop_to {policy.crop_to} must be the image size {image_size}")
    return policy.model_dump(exclude_none=True)


def resize_steps(record: Mapping[str, Any], image_size: int) -> list:
    """torchvision v2 transforms bringing an image of any size to S x S by `record`'s policy (checked already)."""
    from torchvision.transforms import InterpolationMode, v2

    interpolation = InterpolationMode(record.get("interpolation", "bilinear"))
    if record["policy"] == RESIZE_CENTER_CROP:
        return [
            v2.Resize(record["resize_to"], interpolation=interpolation, antialias=True),
            v2.CenterCrop(record["crop_to"]),
        ]
    return [v2.Resize((image_size, image_size), interpolation=interpolation, antialias=True)]


def normalize(mean: Sequence[float], std: Sequence[float]):
    """uint8 image -> float in [0, 1] -> (x - mean) / std: the last steps of every pipeline, training's included."""
    import torch
    from torchvision.transforms import v2

    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))])


def eval_transform(record: Mapping[str, Any], image_size: int, mean: Sequence[float], std: Sequence[float]):
    """PIL image or uint8 tensor (C, H, W) of any size -> normalised float (C, S, S): the evaluation pipeline.

    A PIL image (a file: imagefolder, a packed store, predict) is resized by Pillow itself, before it becomes a tensor:
    Pillow's fixed-point resampling (libImaging/Resample.c) gives the same bytes on every machine, where torch's
    uint8 resize picks a kernel by the CPU's features (torchvision's _do_native_uint8_resize_on_cpu: AVX2 or not), and
    it is what libmobile_moe's C++ preprocessing (its src/preprocess.cpp) reproduces byte for byte."""
    from torchvision.transforms import v2

    return v2.Compose([*resize_steps(record, image_size), v2.ToImage(), normalize(mean, std)])
