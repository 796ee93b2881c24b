"""Checkpoints are plain dicts ({"model": state_dict, "config": dict, ...}) saved with torch.save and loaded with
weights_only=True; a model is rebuilt from its `config` entry alone."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from mobile_moe.atomic import atomic_path
from mobile_moe.errors import UsageError
from mobile_moe.registry import model_from_config_dict


def checkpoint_dict(model: nn.Module, **extra: Any) -> dict[str, Any]:
    """{"model": state_dict, "config": the model's config as a dict, **extra} (optimizer, epoch, ... from training)."""
    return {"model": model.state_dict(), "config": model.config.to_dict(), **extra}


def save_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Atomically write a checkpoint dict (temp file + rename)."""
    with atomic_path(path) as tmp:
        torch.save(checkpoint, tmp)


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise UsageError(f"checkpoint {path} does not exist") from None
    except Exception as error:  # torch raises several types for corrupt or foreign files
        raise UsageError(f"cannot read checkpoint {path}: {error.__class__.__name__}: {error}") from None
    if not isinstance(checkpoint, dict) or "model" not in checkpoint or "config" not in checkpoint:
        raise UsageError(f"{path} is not a mobile-moe checkpoint: expected a dict with 'model' and 'config'")
    return checkpoint


def model_from_checkpoint(checkpoint: dict[str, Any]) -> nn.Module:
    """Rebuild the model from `checkpoint["config"]` and load its weights."""
    model = model_from_config_dict(checkpoint["config"])
    model.load_state_dict(checkpoint["model"])
    return model
