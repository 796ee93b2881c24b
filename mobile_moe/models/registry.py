"""The model registry: every `--model NAME`, its config class, its model class and how it routes.

One table (MODELS) answers every "which model is this?" question: a config's `routing` ("none", "image", "cluster",
"token", "expert", "soft"; see config.MoEConfig) and `is_moe` say what it does, its `model_class` what builds it.
Torch-free until a model is built, so `mobile-moe info` starts instantly. timm-style entry point: `create_model`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from mobile_moe.errors import UsageError
from mobile_moe.models.config import (
    ExpertsChoiceConfig,
    HardMoEConfig,
    MobileVMoEConfig,
    SoftMoEConfig,
    ViTConfig,
    VMoEConfig,
    WideNetConfig,
    parse_size,
)

MODELS: dict[str, type[ViTConfig]] = {
    cls.name: cls
    for cls in (
        ViTConfig,
        MobileVMoEConfig,
        VMoEConfig,
        ExpertsChoiceConfig,
        SoftMoEConfig,
        WideNetConfig,
        HardMoEConfig,
    )
}


def list_models() -> list[str]:
    return sorted(MODELS)


def make_config(name: str, size: str | None = None, **overrides: Any) -> ViTConfig:
    """The config of registered model `name` at `size`, with field overrides (None values are ignored)."""
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    cls = MODELS[name]
    fields = parse_size(size) if size is not None else {}
    fields.update({key: value for key, value in overrides.items() if value is not None})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise UsageError(f"model {name!r} has no option {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**fields)


def config_from_dict(data: dict[str, Any]) -> ViTConfig:
    """Inverse of `to_dict`: rebuilds the config (and so the model) from a checkpoint's `config` entry."""
    data = dict(data)
    name = data.pop("name", None)
    if name not in MODELS:
        raise UsageError(f"config names unknown model {name!r}: expected one of {', '.join(MODELS)}")
    return make_config(name, **data)


def check_fits_memory(cfg: ViTConfig) -> None:
    """UsageError when the model's float32 weights alone would take more than devices.memory_limit(): from flags
    (--size 2x8000000, --experts 1e20, an mlp_ratio of 1e12) or a forged run, torch's allocator failed with a
    traceback, or the kernel killed the process."""
    from mobile_moe.models.costs import costs
    from mobile_moe.utils.devices import over_memory_limit

    params = costs(cfg).params_total
    too_much = over_memory_limit(4 * params)
    if too_much:
        raise UsageError(f"{cfg.name} at this size has {params:.3g} parameters, whose weights need {too_much}; "
                         "choose a smaller model (its size, experts or model options)")  # fmt: skip


def build_model(cfg: ViTConfig):
    """The model a config describes (weights freshly initialised), once check_fits_memory passes."""
    check_fits_memory(cfg)
    module, _, cls = cfg.model_class.partition(":")
    return getattr(importlib.import_module(module), cls)(cfg)


def create_model(name: str, size: str | None = None, **overrides: Any):
    """create_model("mobile-vmoe", "12x192", num_classes=100): config from name, size and overrides, then the model."""
    return build_model(make_config(name, size, **overrides))


def model_from_config_dict(config: dict[str, Any]):
    return build_model(config_from_dict(config))
