"""One training epoch, flat (torchvision references / DeiT `engine.py` style). Evaluation lives in evaluate.py."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mobile_moe.data import augment
from mobile_moe.data.ahead import BatchesAhead
from mobile_moe.data.batch_augment import StepKey
from mobile_moe.data.inputs import CropBatches, DeviceBatches, WorkerBatches
from mobile_moe.training import losses
from mobile_moe.training.attribution import EpochAttribution
from mobile_moe.training.distributed import Placement, mean_over_ranks
from mobile_moe.training.evaluate import autocast, expert_use
from mobile_moe.training.progress import Progress
from mobile_moe.training.recipes import TrainConfig
from mobile_moe.utils.interrupts import held, raise_if_stopped


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
    inputs: WorkerBatches | DeviceBatches | CropBatches  # a loader batch -> augmented images, class targets on device
    assignment: Tensor | None  # (C, E) class -> super-class one-hot, on the device; None without super-classes
    show_progress: bool = True
    log_every: int = 10  # steps between reads of the running sums on the host (and progress updates)
    # called once, with seconds per step and the steps run so far, at the first read after a step other than the
    # process's first (which compiles and warms up): in its first epoch, or the next when that had one step
    estimate: Callable[[float, int], None] | None = None
    steps_run: int = 0  # training steps this process has run, every epoch
    # seconds between reads of the running sums besides every log_every steps: progress within an epoch of a few slow
    # steps (a read is one host sync: every 2 s costs a GPU nothing)
    progress_seconds: float = 2.0
    warmup_s: float = 0.0  # the process's first step's time over a steady step's (compile, warm-up), when timed


@dataclass
class Optimisation:
    """What a training step runs and updates: `step_module` runs the forward (the TrainingForward, possibly DDP- and
    compile-wrapped); `model` is the bare model, for gradient clipping."""

    step_module: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    cuda_graphs: bool = False  # step_module replays CUDA graphs (compile_options): each step must say it begins

    def begin_step(self) -> None:
        """Before a step's forward: the last step's gradients released (so a replay may reuse their memory) and, with
        CUDA graphs, inductor's cudagraph trees told a new step begins (the last step's outputs are dead; an
        unmarked tree would take this forward for the last step's continuation)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()


CUDA_GRAPHED = {"mode": "reduce-overhead"}  # torch.compile's options for a step replayed as CUDA graphs


def compile_options(cfg, device: torch.device, world_size: int = 1) -> dict[str, str]:
    """torch.compile's options for the training step. With `cfg.cuda_graphs` on CUDA (train --compile's default):
    mode="reduce-overhead", inductor's cudagraph trees, which record the step's forward and backward once and replay
    them, so the host's cost a step no longer grows with its kernel launches (a compiled Mobile V-MoE step launches
    several hundred). The shapes are static (the train loader drops its last partial batch) and routing never reads
    the device on the host (moe.py: grouped GEMM offsets are device tensors), so a replay never syncs. The optimizer
    (fused AdamW: one kernel per parameter group) and the running sums stay eager. Else the plain compiled step, and
    under DDP (world_size > 1) too: DDP's gradient all-reduce hooks inside a replayed graph are untested here (no two
    GPUs)."""
    graphed = cfg.cuda_graphs and device.type == "cuda" and world_size == 1
    return dict(CUDA_GRAPHED) if graphed else {}


LOSS_TERMS = ("loss", "class_loss", "router_loss", "balance_loss", "aux_loss")


class EpochSums:
    """An epoch's running sums, kept on the device and read on the host once per log interval (the anchors' pattern:
    nanoGPT, torchvision's references): loss terms, correct images (vs the dominant target) and, for an MoE, how
    training batches were routed (the share of images using each expert, the expert MLPs run per image (see
    evaluate.expert_use) and, for capacity routers, the share of token assignments dropped). This process's share of
    the batches, like train_top1; the total loss is the mean over processes. float64: sums of many float32 steps.

    Each step's total loss is kept until the read, so a NaN or inf is caught at the read and reported at its step.
    """

    def __init__(self, device: torch.device, expert_sets: int, epoch: int, steps: int):
        self.epoch, self.steps, self.expert_sets = epoch, steps, expert_sets
        self.terms = torch.zeros(len(LOSS_TERMS) - 1, dtype=torch.float64, device=device)  # all but "loss"
        self.routing = torch.zeros(3, dtype=torch.float64, device=device)  # correct, dropped x images, expert runs
        self.used: Tensor | None = None  # (E,) images that used each expert
        self.unread: list[Tensor] = []  # the total loss of each step since the last read
        self.images, self.steps_read = 0, 0
        self.host = dict.fromkeys((*LOSS_TERMS, "correct", "dropped", "runs"), 0.0)  # the sums as last read
        self.host_used: list[float] = []

    def add(self, terms: losses.LossTerms, output, targets: Tensor) -> None:
        """One step: nothing is read on the host."""
        self.unread.append(terms.total.detach())
        parts = (terms.classification, terms.router, terms.balance, terms.aux)
        self.terms += torch.stack([part.detach().to(torch.float64) for part in parts])
        correct = (output.logits.detach().argmax(-1) == losses.hard_labels(targets)).sum()
        dropped, runs = output.logits.new_zeros(()), output.logits.new_zeros(())
        use = expert_use(output, self.expert_sets)
        if use is not None:
            used, image_runs = use  # (B, E), (B,)
            dropped = output.stats.dropped.detach() * len(used) if output.stats is not None else dropped
            runs = image_runs.sum()
            used = used.sum(0).to(torch.float64)
            self.used = used if self.used is None else self.used + used
        self.routing += torch.stack([correct, dropped, runs]).to(torch.float64)
        self.images += len(targets)

    def read(self) -> None:
        """The one host sync of a log interval: every sum in one transfer. Raises NonFiniteLoss at the first step
        whose loss was not finite (the epoch is not committed, so the last checkpoint is the last good one)."""
        losses_now = mean_over_ranks(torch.stack(self.unread).to(torch.float64))  # (steps since the last read,)
        used = self.used if self.used is not None else self.terms.new_zeros(0)
        values = torch.cat([losses_now, self.terms, self.routing, used]).tolist()
        unread, terms = len(self.unread), len(self.terms)
        step_losses, values = values[:unread], values[unread:]
        for offset, value in enumerate(step_losses):
            if not math.isfinite(value):
                step = self.steps_read + offset
                raise NonFiniteLoss(value, self.epoch, step, self.epoch * self.steps + step)
        self.host["loss"] += sum(step_losses)
        self.host |= dict(zip(LOSS_TERMS[1:], values[:terms], strict=True))
        self.host["correct"], self.host["dropped"], self.host["runs"] = values[terms : terms + 3]
        self.host_used = values[terms + 3 :]
        self.steps_read += unread
        self.unread = []

    def progress(self, img_s: float) -> dict[str, float]:
        return {"loss": self.host["loss"] / self.steps_read, "acc": self.host["correct"] / self.images, "img_s": img_s}

    def row(self) -> dict[str, object]:
        """The epoch's metrics (after the last read): mean loss terms, top-1 and, for an MoE, the routing."""
        row = {f"train_{name}": self.host[name] / self.steps for name in LOSS_TERMS}
        if self.host_used:
            row |= {
                "train_expert_load": [used / self.images for used in self.host_used],
                "train_experts_per_image": self.host["runs"] / self.images,
                "train_dropped": self.host["dropped"] / self.images,
            }
        return row | {"train_top1": self.host["correct"] / self.images}


def batch_targets(loader_batch, ctx: EpochContext, key: StepKey) -> tuple[Tensor, Tensor, Tensor | None]:
    """A loader batch, on the device and mixed (MixUp/CutMix; augmented too by the device pipeline, drawn from `key`)
    -> (images, targets (B, C), super_targets (B, E) | None)."""
    images, targets = ctx.inputs.batch(loader_batch, key)  # targets (B, C)
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
    """Backward, clip, optimizer and schedule step (the gradients were released by Optimisation.begin_step)."""
    total.backward()
    if grad_clip > 0:
        nn.utils.clip_grad_norm_(opt.model.parameters(), grad_clip)
    opt.optimizer.step()
    opt.scheduler.step()


def train_one_epoch(opt: Optimisation, loader, ctx: EpochContext, *, epoch: int) -> dict[str, float]:
    """Train over `loader` once; -> mean train loss terms, train top-1 (vs the dominant target), images/s and the share
    of the epoch after its first step the host waited for the loader's next batch (`input_wait`, steady_wait),
    images/s after the loader's first round of batches (`steady_images_per_s`, SteadyWindow), and where that window's
    time went (`epoch_parts`, attribution.EpochAttribution).

    The host reads the device once per `ctx.log_every` steps and at the end (EpochSums.read), so a GPU is never
    stalled between steps; a non-finite loss stops training at that read."""
    cfg, world_size, steps = ctx.cfg, ctx.placement.world_size, len(loader)
    opt.step_module.train()
    config = opt.model.config
    sums = EpochSums(ctx.placement.device, config.expert_sets if config.is_moe else 0, epoch, steps)
    progress = Progress(steps, f"epoch {epoch + 1}/{cfg.epochs}", enabled=ctx.placement.is_main and ctx.show_progress)
    # torch.compile traces a step (the first ones, a recompile) under C++ guards that abort the process if a stop
    # unwinds them: a compiled step ends before a stop is raised. An eager step stops at once, since under DDP a rank
    # that held its step would wait in the step's all-reduce for a rank the stop reached between steps (a compiled
    # step can, until torchrun's grace period ends).
    step_guard = held if cfg.compile else contextlib.nullcontext
    start = time.perf_counter()

    def prepare(step: int, loader_batch) -> tuple[Tensor, Tensor, Tensor | None]:
        return batch_targets(loader_batch, ctx, StepKey(cfg.seed, epoch, ctx.placement.rank, step))

    window = SteadyWindow(ctx.placement.device, getattr(loader, "num_workers", 0), steps)
    parts = EpochAttribution(ctx.placement.device, window.first)
    refused_before = ctx.inputs.refused_files  # before the thread that prepares batches ahead starts counting
    batches = BatchesAhead(loader, prepare, ctx.placement.device)  # on CUDA, a thread prepares the next ones
    last_read = start
    try:
        for step in range(steps):
            with parts.next_batch(batches):
                images, targets, super_targets = next(batches)
            raise_if_stopped()  # a stop that a __del__ swallowed ends training here, between two steps
            with parts.step(), step_guard():
                opt.begin_step()
                output, terms = forward_loss(opt.step_module, images, targets, super_targets, cfg)
                update(opt, terms.total, cfg.grad_clip)
            with parts.loop():
                sums.add(terms, output, targets)
                window.stepped(step)
                if step == 0:
                    first_step_done = time.perf_counter()  # the first step compiles, warms up: not in the estimate
                    first_wait = batches.waited  # nor in input_wait: the workers' start, the queue's first fill
                due = time.perf_counter() - last_read >= ctx.progress_seconds
                if due or (step + 1) % ctx.log_every == 0 or step + 1 == steps:
                    sums.read()
                    now = last_read = time.perf_counter()
                    say_estimate(ctx, step, epoch_start=start, first_step_done=first_step_done, now=now)
                    img_s = sums.images * world_size / (now - start)
                    progress.update(steps=step + 1 - progress.done, **sums.progress(img_s))
            parts.stepped(step, batches)
    finally:
        batches.close()
        progress.close()
    elapsed = time.perf_counter() - start
    if ctx.steps_run == 0 and steps > 1:
        ctx.warmup_s = max(0.0, (first_step_done - start) - (elapsed - (first_step_done - start)) / (steps - 1))
    ctx.steps_run += steps
    images = sums.images * world_size
    rates = {"images_per_s": images / elapsed, "epoch_time_s": elapsed,
             "steady_images_per_s": window.images_per_s(images, elapsed)}  # fmt: skip
    return {
        **sums.row(),
        **rates,
        "input_wait": steady_wait(batches.waited, first_wait, elapsed, first_step_done - start, steps),
        "device_refused": ctx.inputs.refused_files - refused_before,  # decoded on the host instead
        "epoch_parts": parts.row(batches),
    }


def steady_wait(waited: float, first_wait: float, elapsed: float, first_step: float, steps: int) -> float:
    """The share of the epoch after its first step that the host blocked for its next batch (the whole epoch's when
    it had one step): the steady state, without the start-up that every epoch of a short run would otherwise carry."""
    if steps <= 1 or elapsed <= first_step:
        return waited / elapsed
    return (waited - first_wait) / (elapsed - first_step)


class SteadyWindow:
    """An epoch's images/s after the loader's first round, the rate of a long epoch where the step is the slower
    half (a compiled step on a GPU). The loader's W workers start together, so its first batch costs the epoch a
    whole batch's decode that no later step waits for, and its first W batches arrive at about the same time: the
    window runs from the end of step W (the first, for a loader without workers) to the epoch's end. On CUDA it is
    read from events on the step's stream (the GPU's time: the host runs steps ahead of it between the epoch's
    reads), else from perf_counter. Where the loader is the slower half, an epoch's last batches (up to its workers
    times their prefetch) were finished ahead and come faster than its pace, and the window keeps them: on this
    project's CPU machine the per-image pipeline (2 workers) read 196-216 images/s at 20 steps an epoch and 181-192
    at 80 (the whole epoch: 165-184 and 175-186, its slow start and fast end about cancelling)."""

    def __init__(self, device: torch.device, workers: int, steps: int):
        self.first = min(max(workers, 1), steps) - 1  # the step whose end opens the window
        self.steps, self.cuda, self.opened = steps, device.type == "cuda", None

    def stepped(self, step: int) -> None:
        if step == self.first:
            self.opened = self._mark()

    def images_per_s(self, images: float, elapsed: float) -> float:
        """The window's images/s, of the epoch's `images` over its `elapsed` seconds (their rate, for an epoch of no
        more steps than the loader has workers)."""
        if self.opened is None or self.first == self.steps - 1:
            return images / elapsed
        closed = self._mark()
        if self.cuda:
            closed.synchronize()
            seconds = self.opened.elapsed_time(closed) / 1e3
        else:
            seconds = closed - self.opened
        return images * (self.steps - 1 - self.first) / self.steps / seconds

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


def say_estimate(ctx: EpochContext, step: int, *, epoch_start: float, first_step_done: float, now: float) -> None:
    """Time a step for ctx.estimate, once, from perf_counter readings: over this epoch's steps after its first, or,
    in an epoch after the process's first, the epoch's first step itself (an epoch of one step: digits at batch
    1024)."""
    if ctx.estimate is None or (step == 0 and ctx.steps_run == 0):
        return
    seconds = (now - first_step_done) / step if step > 0 else first_step_done - epoch_start
    ctx.estimate(seconds, ctx.steps_run + step + 1)
    ctx.estimate = None
