"""Evaluation: top-1 / top-5, router accuracy against super-classes, per-expert load and accuracy; and the raw
softmax predictions mobile_moe/super_class/ builds confusion matrices from (`confusion_from_run`: a run's, on a split).

Counts are summed per process and all-reduced, so under DDP each process evaluates its own shard of the split.
Routing is the model's own (inference behaviour), whatever training used. Legend: N images, C classes, E experts.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from mobile_moe.errors import UsageError
from mobile_moe.formats.confusion import Confusion, confusion_from_predictions
from mobile_moe.training.run_dir import load_run
from mobile_moe.utils.devices import resolve_device


def autocast(device: torch.device | str, enabled: bool = True):
    """bf16 autocast on CUDA; a no-op elsewhere (CPU training stays in float32, exactly reproducible)."""
    device = torch.device(device)
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def in_order(dataset: Dataset, batch_size: int) -> DataLoader:
    """The dataset's items in order, `batch_size` at a time; a batch size beyond the dataset is the whole dataset
    (DataLoader's sampler slices with itertools.islice, which refuses a stop beyond sys.maxsize)."""
    return DataLoader(dataset, batch_size=max(1, min(batch_size, len(dataset))), shuffle=False)


def _batches(dataset: Dataset, batch_size: int, device):
    for images, labels in in_order(dataset, batch_size):
        yield images.to(device, non_blocking=True), labels.to(device, non_blocking=True)


@torch.no_grad()
def collect_predictions(
    model: nn.Module, dataset: Dataset, batch_size: int = 256, device: str | torch.device = "cpu"
) -> tuple[np.ndarray, np.ndarray]:
    """-> (probs (N, C) float64 softmax, labels (N,) int64), in dataset order."""
    was_training = model.training
    model.eval()
    probs, labels = [], []
    for images, batch_labels in _batches(dataset, batch_size, device):
        probs.append(model(images).logits.float().softmax(dim=-1).double().cpu())
        labels.append(batch_labels.cpu())
    model.train(was_training)
    return torch.cat(probs).numpy(), torch.cat(labels).numpy().astype(np.int64)


def confusion_from_run(
    run_dir: str | os.PathLike,
    data_spec: str | None = None,
    split: str = "val",
    hard: bool = False,
    device: str = "auto",
    batch_size: int = 256,
) -> Confusion:
    """The confusion matrix of a trained run's best checkpoint on a data split (soft unless `hard`), for
    super_class.derive_super_classes. `data_spec` defaults to the run's own data; images are normalised with the
    statistics the run recorded."""
    device = resolve_device(device)  # a typo is refused before the run is read
    run = load_run(run_dir, checkpoint="best")
    data = run.open_data(data_spec)  # the run's own data by default; refuses data with other classes
    spec = data.spec
    dataset = data.split(split)
    if len(dataset) == 0:
        raise UsageError(f"--data {spec} --split {split} has no images; choose another split")
    probs, labels = collect_predictions(run.model.to(device), dataset, batch_size=batch_size, device=device)
    matrix = confusion_from_predictions(probs, labels, hard=hard, num_classes=len(data.class_names))
    kind = "hard" if hard else "soft"
    return Confusion(matrix, list(data.class_names), f"run:{run_dir} data:{spec} split:{split} {kind}")


@dataclass
class EvalCounts:
    """Sums over images; add-able across batches and all-reducible across processes."""

    images: Tensor  # () number of images
    top1: Tensor  # () correct at top-1
    top5: Tensor  # () correct at top-5 (top-C when C < 5)
    router: Tensor  # () router's top choice == true super-class (only with super-classes)
    expert_images: Tensor  # (E,) images that used expert e (any of their choices, in any MoE block)
    expert_first: Tensor  # (E,) images whose first choice was e (per-image routing)
    expert_first_correct: Tensor  # (E,) ... and were classified correctly
    experts_used: Tensor  # (G*E + 1,) images by how many experts (over the G expert sets) they ran: all-reducible
    dropped: Tensor  # () sum over images of the share of their token assignments dropped for capacity

    @classmethod
    def zeros(cls, num_experts: int, expert_sets: int, device) -> EvalCounts:
        z = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=device)  # noqa: E731
        E = num_experts
        return cls(z(), z(), z(), z(), z(E), z(E), z(E), z(expert_sets * E + 1 if E else 0), z())

    def as_tensor(self) -> Tensor:
        return torch.cat([t.reshape(-1) for t in vars(self).values()])

    def all_reduce(self) -> None:
        """Sum over DDP processes (no-op when not distributed)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        flat = self.as_tensor()
        dist.all_reduce(flat)
        offset = 0
        for name, value in vars(self).items():
            setattr(self, name, flat[offset : offset + value.numel()].reshape(value.shape))
            offset += value.numel()


def count_batch(counts: EvalCounts, output, labels: Tensor, super_of: Tensor | None, expert_sets: int = 0) -> None:
    logits = output.logits.float()
    top = logits.topk(min(5, logits.shape[1]), dim=-1).indices  # (B, 5)
    correct = top[:, 0] == labels  # (B,)
    counts.images += len(labels)
    counts.top1 += correct.sum()
    counts.top5 += (top == labels[:, None]).any(dim=-1).sum()
    use = expert_use(output, expert_sets)
    if use is not None:
        used, runs = use
        counts.expert_images += used.sum(0)
        counts.experts_used += torch.bincount(runs, minlength=len(counts.experts_used))
    if output.stats is not None:
        counts.dropped += output.stats.dropped.double() * len(labels)
    routing = output.routing
    if routing is None:
        return
    E = routing.probs.shape[-1]
    first = routing.experts[:, 0]  # (B,)
    counts.expert_first += torch.bincount(first, minlength=E)
    counts.expert_first_correct += torch.bincount(first[correct], minlength=E)
    if super_of is not None:
        counts.router += (routing.probs.argmax(dim=-1) == super_of[labels]).sum()


def expert_use(output, expert_sets: int) -> tuple[Tensor, Tensor] | None:
    """Which experts each image used: (used (B, E) bool, in any expert set; runs (B,) int64, the expert MLPs it ran
    over all G expert sets), from a per-image Routing (one decision serves every set) or a per-token model's
    MoEStats; None for a dense model. The one reading of both, for evaluation and for training's metrics."""
    if output.stats is not None:
        per_set = output.stats.expert_tokens.detach() > 0  # (B, G, E)
        return per_set.any(dim=1), per_set.sum(dim=(1, 2))
    if output.routing is None:
        return None
    E = output.routing.probs.shape[-1]
    used = torch.nn.functional.one_hot(output.routing.experts.detach(), E).amax(dim=1) > 0  # (B, E)
    return used, used.sum(-1) * expert_sets


def experts_used_summary(histogram: Tensor) -> dict[str, float | int]:
    """(G*E + 1,) images by number of experts run -> mean and max (Fig. 3e: the parameters one image activates)."""
    images = histogram.sum().item()
    counts = torch.arange(len(histogram), dtype=histogram.dtype, device=histogram.device)
    used = torch.nonzero(histogram).flatten()
    return {
        "experts_per_image_mean": (histogram * counts).sum().item() / max(images, 1.0),
        "experts_per_image_max": int(used.max().item()) if len(used) else 0,
    }


def summarize(counts: EvalCounts, has_router: bool, has_super: bool) -> dict[str, Any]:
    n = max(counts.images.item(), 1.0)
    result: dict[str, Any] = {
        "images": int(counts.images.item()),
        "top1": counts.top1.item() / n,
        "top5": counts.top5.item() / n,
        "router_accuracy": counts.router.item() / n if has_super else None,
    }
    if has_router:
        result["expert_load"] = (counts.expert_images / n).tolist()
        result["expert_accuracy"] = [
            (c / f) if f > 0 else None
            for c, f in zip(counts.expert_first_correct.tolist(), counts.expert_first.tolist(), strict=True)
        ]
        result.update(experts_used_summary(counts.experts_used))
        result["dropped"] = counts.dropped.item() / n
    return result


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Dataset,
    super_assignment: list[int] | None = None,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    amp: bool = True,
) -> dict[str, Any]:
    """-> {"images", "top1", "top5", "router_accuracy" (None without super-classes), and for MoE models
    "expert_load" (share of images using each expert in any MoE block; sums to the mean of distinct experts),
    "expert_accuracy" (top-1 of the images whose first choice was the expert; None if none, and for routers with no
    per-image first choice), "experts_per_image_mean" / "experts_per_image_max" (expert MLPs one image runs, over
    all expert sets: k x L for a Mobile V-MoE, data-dependent for per-token routers; times an expert's parameters,
    what an image needs in memory) and "dropped" (mean share of an image's token assignments dropped for capacity)}.
    Under DDP pass each process its shard; counts are all-reduced."""
    cfg = model.config
    num_experts, expert_sets = (cfg.num_experts, cfg.expert_sets) if cfg.is_moe else (0, 0)
    has_router = num_experts > 0
    super_of = torch.as_tensor(super_assignment, device=device) if super_assignment is not None else None
    counts = EvalCounts.zeros(num_experts, expert_sets, device)
    was_training = model.training
    model.eval()
    for images, labels in _batches(dataset, batch_size, device):
        with autocast(device, amp):
            output = model(images)
        count_batch(counts, output, labels, super_of, expert_sets)
    model.train(was_training)
    counts.all_reduce()
    return summarize(counts, has_router, has_router and super_of is not None)
