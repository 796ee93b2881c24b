"""Model registry: names -> model classes, and the timm-style `create_model` entry point."""

from __future__ import annotations

from typing import Any

from torch import nn

from mobile_moe.config import ViTConfig, config_from_dict, make_config
from mobile_moe.mobile_vmoe import MobileVMoE
from mobile_moe.vit import VisionTransformer

MODELS: dict[str, type[nn.Module]] = {"vit": VisionTransformer, "mobile-vmoe": MobileVMoE}


def list_models() -> list[str]:
    return sorted(MODELS)


def build_model(cfg: ViTConfig) -> nn.Module:
    """The model a config describes (weights freshly initialised)."""
    return MODELS[cfg.name](cfg)


def create_model(name: str, size: str | None = None, **overrides: Any) -> nn.Module:
    """create_model("mobile-vmoe", "12x192", num_classes=100): config from name, size and overrides, then the model."""
    return build_model(make_config(name, size, **overrides))


def model_from_config_dict(config: dict[str, Any]) -> nn.Module:
    return build_model(config_from_dict(config))
