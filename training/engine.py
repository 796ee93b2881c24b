"""One training epoch, flat (torchvision references / DeiT `engine.py` style). Evaluation lives in evaluate.py."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mobile_moe.training import augment, losses
from mobile_moe.training.distributed import Placement, mean_over_ranks
from mobile_moe.training.evaluate import autocast, expert_use
from mobile_moe.training.progress import Progress
from mobile_moe.training.recipes import TrainConfig


class NonFiniteLoss(Exception):
    """The loss became NaN or inf; training stops and keeps the last good checkpoint."""

    def __init__(self, value: float, epoch: int, step: int, global_step: int):
        super().__init__(f"loss {value} at epoch {epoch + 1}, step {step + 1} (global step {global_step + 1})")
        self.value, self.epoch, self.step, self.global_step = value, epoch, step, global_step


@dataclass
class EpochContext:
    """What an epoch needs besides the model: fixed for the whole run."""

    cfg: TrainConfig
    placement: Placement
    num_classes: int
    assignment: Tensor | None  # (C, E) class -> super-class one-hot, on the device; None without super-classes
    mixer: object | None  # MixUp/CutMix batch transform
    show_progress: bool = True


class RoutingSums:
    """How training batches were routed, for the epoch's metrics row: the share of images using each expert, the
    expert MLPs run per image (see evaluate) and (capacity routers) the share of token assignments dropped, under
    training's capacity and noise. This process's share of the batches, like train_top1."""

    def __init__(self, expert_sets: int):
        self.expert_sets = expert_sets
        self.images, self.dropped, self.used = 0, 0.0, None  # used: (E,) images that used each expert
        self.runs = 0.0  # expert MLP runs, over all expert sets

    def add(self, output) -> None:
        use = expert_use(output, self.expert_sets)
        if use is None:
            return
        used, runs = use  # (B, E), (B,)
        if output.stats is not None:
            self.dropped += output.stats.dropped.item() * len(used)
        used = used.float().sum(0)  # (E,)
        self.used = used if self.used is None else self.used + used
        self.runs += runs.sum().item()
        self.images += len(runs)

    def summary(self) -> dict[str, object]:
        if not self.images:
            return {}
        return {
            "train_expert_load": (self.used / self.images).tolist(),
            "train_experts_per_image": self.runs / self.images,
            "train_dropped": self.dropped / self.images,
        }


@dataclass
class Optimisation:
    """What a training step runs and updates: `step_module` runs the forward (the TrainingForward, possibly DDP- and
    compile-wrapped); `model` is the bare model, for gradient clipping."""

    step_module: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


LOSS_TERMS = ("loss", "class_loss", "router_loss", "balance_loss", "aux_loss")


class EpochSums:
    """Running sums over an epoch's steps: loss terms, correct images (vs the dominant target) and images seen."""

    def __init__(self):
        self.terms = dict.fromkeys(LOSS_TERMS, 0.0)
        self.correct, self.images = 0.0, 0

    def add(self, loss_value: float, terms: losses.LossTerms, correct: float, images: int) -> None:
        self.terms["loss"] += loss_value
        self.terms["class_loss"] += terms.classification.item()
        self.terms["router_loss"] += terms.router.item()
        self.terms["balance_loss"] += terms.balance.item()
        self.terms["aux_loss"] += terms.aux.item()
        self.correct += correct
        self.images += images

    def row(self, steps: int) -> dict[str, float]:
        return {f"train_{name}": total / steps for name, total in self.terms.items()}


def batch_targets(images: Tensor, labels: Tensor, ctx: EpochContext) -> tuple[Tensor, Tensor, Tensor | None]:
    """A loader batch on the device, mixed (MixUp/CutMix) -> (images, targets (B, C), super_targets (B, E) | None)."""
    device = ctx.placement.device
    images = images.to(device, non_blocking=True)
    labels = labels.to(device, non_blocking=True)
    images, targets = augment.class_targets(images, labels, ctx.num_classes, ctx.mixer)  # targets (B, C)
    super_targets = augment.super_targets(targets, ctx.assignment) if ctx.assignment is not None else None
    return images, targets, super_targets


def forward_loss(step_module: nn.Module, images: Tensor, targets: Tensor, super_targets: Tensor | None, cfg):
    """-> (the model's output, its loss terms), under autocast."""
    with autocast(images.device, cfg.amp):
        super_labels = super_targets.argmax(-1) if super_targets is not None else None
        output = step_module(images, super_labels)
        terms = losses.training_loss(
            output, targets, super_targets, cfg.router_loss_weight, cfg.balance_loss_weight, cfg.label_smoothing
        )
    return output, terms


def update(opt: Optimisation, total: Tensor, grad_clip: float) -> None:
    """Backward, clip, optimizer and schedule step."""
    opt.optimizer.zero_grad(set_to_none=True)
    total.backward()
    if grad_clip > 0:
        nn.utils.clip_grad_norm_(opt.model.parameters(), grad_clip)
    opt.optimizer.step()
    opt.scheduler.step()


def train_one_epoch(opt: Optimisation, loader, ctx: EpochContext, *, epoch: int) -> dict[str, float]:
    """Train over `loader` once; -> mean train loss terms, train top-1 (vs the dominant target) and images/s."""
    cfg, world_size, steps = ctx.cfg, ctx.placement.world_size, len(loader)
    opt.step_module.train()
    sums = EpochSums()
    routed = RoutingSums(opt.model.config.expert_sets if opt.model.config.is_moe else 0)
    progress = Progress(steps, f"epoch {epoch + 1}/{cfg.epochs}", enabled=ctx.placement.is_main and ctx.show_progress)
    start = time.perf_counter()
    for step, (images, labels) in enumerate(loader):
        images, targets, super_targets = batch_targets(images, labels, ctx)
        output, terms = forward_loss(opt.step_module, images, targets, super_targets, cfg)
        # One host sync per step, as in DeiT: a NaN must stop training before it reaches the weights.
        loss_value = mean_over_ranks(terms.total.detach()).item()
        if not math.isfinite(loss_value):
            progress.close()
            raise NonFiniteLoss(loss_value, epoch, step, epoch * steps + step)
        update(opt, terms.total, cfg.grad_clip)
        correct = (output.logits.argmax(-1) == losses.hard_labels(targets)).float().sum().item()
        sums.add(loss_value, terms, correct, len(labels))
        routed.add(output)
        img_s = sums.images * world_size / (time.perf_counter() - start)
        progress.update(loss=sums.terms["loss"] / (step + 1), acc=sums.correct / sums.images, img_s=img_s)
    progress.close()
    elapsed = time.perf_counter() - start
    return {
        **sums.row(steps),
        **routed.summary(),
        "train_top1": sums.correct / sums.images,  # this process's share; against the dominant (mixed) class
        "images_per_s": sums.images * world_size / elapsed,
        "epoch_time_s": elapsed,
    }
