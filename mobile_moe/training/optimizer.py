"""Training's optimiser and schedule: AdamW over two parameter groups (weight decay on matrices only), the warm-up and
cosine schedule, and a checkpoint's saved state loaded back, including the state of runs saved when each expert had
its own parameters (restacked onto today's stacked experts, moe.StackedModules)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mobile_moe.errors import UsageError
from mobile_moe.models.checkpoint import first_reason, load_weights
from mobile_moe.models.moe import is_stacked, per_expert_key, stacked
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


def optimizer_order(named: list[tuple[str, Tensor]]) -> list[str]:
    """The names of these trainable parameters in the order their optimizer state is indexed (parameter_groups)."""
    return [name for name, p in named if decays(name, p)] + [name for name, p in named if not decays(name, p)]


def restacked_optimizer_state(saved: dict[str, Any], saved_model: dict[str, Tensor], model: nn.Module) -> dict:
    """AdamW's state saved when each expert had its own parameters (saved_model in that per-expert layout) -> the
    state for the stacked parameters (moe.StackedModules) of `model`. A state of today's layout comes back as it is."""
    if not any(per_expert_key(key) for key in saved_model):
        return saved
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    names = {name for name, _ in trainable}
    now = {key: (per_expert_key(key) or (key, 0)) for key in saved_model}  # (the parameter it is part of, expert)
    old = optimizer_order([(key, value) for key, value in saved_model.items() if now[key][0] in names])
    parts_of: dict[str, list[tuple[int, Any]]] = {}  # each parameter's saved states, with their experts
    for index, key in enumerate(old):
        parts_of.setdefault(now[key][0], []).append((now[key][1], saved["state"].get(index)))
    state = {}
    for index, name in enumerate(optimizer_order(trainable)):
        parts = [part for _, part in sorted(parts_of.get(name, []), key=lambda pair: pair[0])]
        if any(parts):  # a parameter not yet stepped has no state
            state[index] = stacked_moments(with_zero_moments(parts)) if is_stacked(name) else parts[0]
    groups, start = [], 0
    for group, params in zip(saved["param_groups"], parameter_groups(model, 0.0), strict=True):
        groups.append({**group, "params": list(range(start, start + len(params["params"])))})
        start += len(params["params"])
    return {"state": state, "param_groups": groups}


def with_zero_moments(parts: list[dict[str, Tensor] | None]) -> list[dict[str, Tensor]]:
    """Each expert's AdamW state, an expert never stepped (no state: it never had an image) given zero moments, which is
    what AdamW starts it from; the step is the stack's, shared."""
    template = next(part for part in parts if part)
    zeros = {key: value if key == "step" else torch.zeros_like(value) for key, value in template.items()}
    return [part or zeros for part in parts]


def stacked_moments(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One stacked parameter's AdamW state from its experts' states: moments stacked as the weights are (moe.stacked),
    the step shared."""
    return {key: parts[0][key] if key == "step" else stacked([part[key] for part in parts]) for key in parts[0]}


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
        saved = restacked_optimizer_state(state["optimizer"], state["model"], model)
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
