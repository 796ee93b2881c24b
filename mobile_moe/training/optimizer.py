"""Training's optimiser and schedule: AdamW over two parameter groups (weight decay on matrices only), the warm-up and
cosine schedule, and a checkpoint's saved state loaded back."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mobile_moe.errors import UsageError
from mobile_moe.models.checkpoint import first_reason, load_weights
from mobile_moe.models.moe import is_stacked
from mobile_moe.training.recipes import TrainConfig


def decays(name: str, param: Tensor) -> bool:
    """AdamW's weight decay applies to this parameter: to matrices, not to biases, norms, position embedding and class
    token (DeiT). A stacked entry (moe.is_stacked) is judged by one expert's tensor: its (E, D) norms do not decay."""
    expert_ndim = param.ndim - 1 if is_stacked(name) else param.ndim
    return expert_ndim >= 2 and not name.endswith(("bias", "pos_embed", "cls_token"))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters only, in two groups: with weight decay (`decays`) and without."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:  # not frozen (a Hard MoE's gater trunk): the optimizer never sees a frozen one
            (decay if decays(name, param) else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(model: nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """Training's optimiser: AdamW over parameter_groups, fused on CUDA and the CPU alike (`torch._fused_adamw_`: one
    pass over each parameter for its whole update, where foreach makes a pass per elementwise op). On this project's
    CPU machine the step of ViT-Ti/32's 6.1 M parameters took 3.4 ms fused against 20 ms foreach, and Mobile V-MoE's
    11.5 M (its E experts in two blocks) 6.4 ms against 32: much of the MoE step's time over dense's. A run resumed
    from a checkpoint keeps the kernel it was saved with (torch's load_state_dict restores the param groups' flags)."""
    return torch.optim.AdamW(parameter_groups(model, weight_decay), lr=lr, fused=True)


def cosine_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig, steps_per_epoch: int):
    """Linear warm-up to cfg.lr, then cosine decay to cfg.min_lr; stepped every iteration."""
    total = cfg.epochs * steps_per_epoch
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    floor = min(cfg.min_lr / cfg.lr, 1.0) if cfg.lr > 0 else 0.0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(1, total - warmup), 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def load_training_state(state: dict[str, Any], path: Path, model, optimizer, scheduler) -> None:
    load_weights(model, state["model"], path)
    try:
        saved = state["optimizer"]
        check_moments(saved, optimizer)
        optimizer.load_state_dict(saved)
        # The schedule follows the current cfg.epochs: a resumed run given more epochs stretches its cosine.
        scheduler.load_state_dict(state["scheduler"])
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as error:
        raise UsageError(
            f"{path}: its optimizer or scheduler state does not fit the model ({first_reason(error)}); "
            "the file was damaged or edited: start a new --out"
        ) from None


def check_moments(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """ValueError unless each saved AdamW state belongs to a parameter of `optimizer` and its moments have that
    parameter's shape, a floating dtype and the strided layout: torch's fused kernel reads a moment at its parameter's
    size whatever the moment's own (a smaller one corrupted memory, a larger one trained on silently)."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for index, entry in saved["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(entry, dict):
            raise ValueError(f"a state for parameter {index!r}, of {len(params)}")
        for key, value in entry.items():
            fits = isinstance(value, Tensor) and value.layout == torch.strided and value.is_floating_point()
            if key != "step" and not (fits and value.shape == params[index].shape):
                raise ValueError(f"parameter {index}'s {key}")
