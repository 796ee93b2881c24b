"""`train(...)`: the whole training run, in commented sections; `resume_training(run_dir)` continues one.

    from mobile_moe.models.registry import make_config
    from mobile_moe.training import recipes
    from mobile_moe.training.train import train

    run_dir = train(make_config("mobile-vmoe", "6x64", patch_size=8, image_size=32, num_classes=10, num_experts=5),
                    recipes.tiny(), data_spec="digits", super_class_spec="random", out_dir="runs/digits-moe")

Reproducibility: the model is initialised from `seed`; every epoch reseeds augmentation from (seed, epoch, rank) and
the sampler shuffles from (seed, epoch). A resumed run therefore replays exactly the epochs an uninterrupted run
would have (bit-exact on CPU); the checkpoint also records the RNG states it was saved with.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from mobile_moe.data import augment, inputs
from mobile_moe.data.crop import KeyedBatches
from mobile_moe.data.datasets import Data, data_record, materialized, open_data
from mobile_moe.errors import UsageError
from mobile_moe.formats.superclasses import SuperClasses
from mobile_moe.models.checkpoint import checkpoint_dict, load_checkpoint
from mobile_moe.models.config import ViTConfig
from mobile_moe.models.moe import compile_model, expert_dispatch
from mobile_moe.models.registry import build_model, config_from_dict
from mobile_moe.training import cluster_fit, distributed, host_memory
from mobile_moe.training import init_from as upcycling
from mobile_moe.training.engine import EpochContext, NonFiniteLoss, Optimisation, compile_options, train_one_epoch
from mobile_moe.training.estimate import say_run_estimate, time_left
from mobile_moe.training.evaluate import evaluate
from mobile_moe.training.imported import refuse_resume, refuse_training_into
from mobile_moe.training.loader_failures import worker_failure
from mobile_moe.training.optimizer import adamw, cosine_schedule, load_training_state
from mobile_moe.training.recipes import MAY_CHANGE_ON_RESUME, TrainConfig, from_dict
from mobile_moe.training.routing import TrainingForward, collapse_warning
from mobile_moe.training.run_dir import (
    CONFIG,
    LAST,
    check_commit_point,
    commit_epoch,
    differing_fields,
    holds_results,
    is_failed_start,
    metrics_rows_problem,
    preprocessing,
    read_config,
    reconcile,
    remove_stale_temporaries,
    run_lock,
    write_config,
)
from mobile_moe.training.super_spec import resolve_super_classes, super_record
from mobile_moe.utils.atomic import check_writable
from mobile_moe.utils.devices import usable_cores
from mobile_moe.utils.interrupts import leave_stops_to_the_main_process
from mobile_moe.utils.words import counted

# --- pieces -------------------------------------------------------------------------------------------------------


def seed_epoch(seed: int, epoch: int, rank: int) -> None:
    torch.manual_seed(seed * 1_000_003 + epoch * 1_009 + rank + 1)


def rng_states() -> dict[str, Any]:
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def check_model_fits_data(model_config: ViTConfig, data: Data) -> None:
    if data.num_classes < 2:
        raise UsageError(
            f"{data.spec} has one class ({data.class_names[0]!r}): a classifier needs at least two, or every image "
            "is right by construction; add a folder per class"
        )
    if model_config.num_classes != data.num_classes:
        raise UsageError(
            f"the model has {model_config.num_classes} classes but {data.spec} has {data.num_classes}; "
            f"use --num-classes {data.num_classes} (or leave it out)"
        )
    if model_config.in_chans != 3:
        raise UsageError(f"in_chans={model_config.in_chans}: the data pipelines produce 3-channel images")


def check_super_classes(model_config: ViTConfig, super_classes, cfg: TrainConfig) -> None:
    if model_config.routing == "image" and super_classes is None and cfg.router_loss_weight > 0:
        raise UsageError(
            "a Mobile V-MoE with a router loss needs --super-classes (FILE.json, coarse, truth or random[:SEED]); "
            "or train end to end with --router-loss 0 [--balance-loss 0.01]"
        )
    fixed_router_loss = cfg.balance_loss_weight > 0 or (cfg.router_loss_weight > 0 and super_classes is not None)
    if model_config.routing == "cluster" and fixed_router_loss:
        raise UsageError(
            "a Hard MoE's router is fixed k-means, it has no router or balance loss: drop --super-classes (or give "
            "--router-loss 0 to only score its routing against them) and --balance-loss"
        )
    if model_config.is_moe and not model_config.per_image:
        _check_per_token_losses(model_config, super_classes, cfg)
    if cfg.route_by == "label" and super_classes is None:
        raise UsageError("--route-by label needs --super-classes: it routes each image to its true super-class")


def _check_per_token_losses(model_config: ViTConfig, super_classes, cfg: TrainConfig) -> None:
    """A per-token router has no per-image decision for a super-class loss, and weights its own balancing losses:
    flags that would otherwise do nothing are refused."""
    name = model_config.name
    if super_classes is not None:
        raise UsageError(
            f"--super-classes guides a per-image router; {name} routes every token itself: drop --super-classes"
        )
    if cfg.balance_loss_weight > 0:
        own = "--model-kwargs aux_loss_weight=W" if hasattr(model_config, "aux_loss_weight") else None
        hint = f"its own auxiliary loss is weighted by {own}" if own else "it needs no balancing loss"
        raise UsageError(f"--balance-loss applies to mobile-vmoe's router; {name}: {hint}; drop --balance-loss")


def check_routing_groups(model_config: ViTConfig, images_per_step: int) -> None:
    """Each process's batch must split into whole routing groups (token_moe.MoELayer); the loader drops the last
    partial batch, so every step's batch is `images_per_step`."""
    group = getattr(model_config, "routing_group_images", 1)
    if images_per_step % group:
        raise UsageError(
            f"each process trains on batches of {images_per_step} images, which do not split into routing groups of "
            f"routing_group_images={group}; use a --batch-size whose share per process is a multiple of {group}"
        )


def make_loader(
    dataset, cfg: TrainConfig, placement: distributed.Placement, collate_fn=None
) -> tuple[DataLoader, DistributedSampler | KeyedBatches]:
    """Each process gets batch_size / world_size images per step; the sampler shuffles from (seed, epoch), so the
    union of the processes' batches is the same global batch a single process would draw. -> (the loader, what
    takes set_epoch: the sampler, or for the crop pipeline the batch sampler over it)."""
    if cfg.batch_size % placement.world_size:
        raise UsageError(
            f"--batch-size {cfg.batch_size} does not split over {placement.world_size} processes; "
            f"use a multiple of {placement.world_size}"
        )
    per_rank = cfg.batch_size // placement.world_size
    if cfg.batch_size > len(dataset):
        raise UsageError(
            f"--batch-size {cfg.batch_size} is larger than the {len(dataset)} training images; "
            f"use --batch-size {len(dataset)} or less"
        )
    workers = effective_workers(cfg.workers)
    sampler = DistributedSampler(
        dataset, num_replicas=placement.world_size, rank=placement.rank, shuffle=True, seed=cfg.seed, drop_last=True
    )
    if cfg.input_pipeline == "crop":  # a worker reads a whole batch, keyed by its step (crop.py)
        batches = KeyedBatches(sampler, per_rank, seed=cfg.seed, rank=placement.rank)
        loader = DataLoader(dataset, batch_sampler=batches, num_workers=workers, collate_fn=collate_fn,
                            pin_memory=placement.device.type == "cuda", persistent_workers=workers > 0,
                            worker_init_fn=leave_stops_to_the_main_process)  # fmt: skip
        return loader, batches
    loader = DataLoader(
        dataset,
        batch_size=per_rank,
        sampler=sampler,
        num_workers=workers,
        drop_last=True,
        pin_memory=placement.device.type == "cuda",
        collate_fn=collate_fn,
        worker_init_fn=leave_stops_to_the_main_process,
        # Workers that only decode draw nothing, so they may live across epochs (per-image augmentation is reseeded
        # from (seed, epoch, rank) through fresh workers: those restart each epoch).
        persistent_workers=workers > 0 and cfg.input_pipeline == "device",
    )
    return loader, sampler


def epoch_line(row: dict[str, Any]) -> str:
    text = f"epoch {row['epoch']:>3}  loss {row['train_loss']:.4f}  val top-1 {100 * row['val_top1']:.2f}%"
    text += f"  top-5 {100 * row['val_top5']:.2f}%"
    if row.get("router_accuracy") is not None:
        text += f"  router {100 * row['router_accuracy']:.2f}%"
    text += f"  {row['images_per_s']:.0f} img/s"
    if row.get("input_wait") is not None:
        text += f" ({100 * row['input_wait']:.0f}% waiting for input)"
    if row.get("device_refused"):
        text += f", {counted(row['device_refused'], 'file')} decoded on the host (the device's decoder refused them)"
    return text + f"  lr {row['lr']:.2e}"


# --- entry points -------------------------------------------------------------------------------------------------


def train(
    model_config: ViTConfig,
    train_config: TrainConfig,
    data_spec: str,
    super_class_spec: str | None,
    out_dir: str | os.PathLike,
    verbose: bool = True,
    fit_num_classes: bool = False,
    init_from: str | os.PathLike | None = None,
    notes: Sequence[str] = (),
) -> Path:
    """Train a new run into `out_dir` (which must not hold a run already); -> out_dir.

    model_config: e.g. make_config("mobile-vmoe", "6x64", ...); its num_classes must be the data's, unless
    `fit_num_classes` (the CLI without --num-classes) sets it from the data. super_class_spec: FILE.json, coarse,
    truth, random[:SEED] or None (super_spec.py). Prints one line per epoch unless not `verbose`. init_from: a
    dense vit run the model starts from (a vit fine-tuned, an MoE upcycled, a hard-moe's gater; data of other
    classes gets a new classifier; mobile_moe/training/init_from.py). notes: lines said on stderr once the inputs are
    checked, before epoch 1 (a refusal stays one line).
    """
    upcycling.check_init_from(model_config, init_from)
    out_dir = Path(out_dir)
    check_writable(out_dir, directory=True)
    with run_lock(out_dir):  # the checks and the training under one lock: no second command passes them meanwhile
        check_new_run_dir(out_dir)
        request = TrainRequest(model_config, train_config, data_spec, super_class_spec, out_dir, verbose=verbose,
                               fit_num_classes=fit_num_classes, init_from=init_from, notes=tuple(notes))  # fmt: skip
        return _train(request)


def check_new_run_dir(out_dir: Path) -> None:
    """A new run may go into `out_dir`: it holds no run, and no config.json but a failed start's."""
    if holds_results(out_dir):
        refuse_training_into(out_dir)  # an imported run: say so, not "continue it with --resume"
        check_commit_point(out_dir)  # results without their checkpoint.pt: --resume has nothing to continue from
        raise UsageError(f"{out_dir} already holds a run; continue it with --resume or choose another --out")
    if (out_dir / CONFIG).exists() and not is_failed_start(out_dir):
        raise UsageError(f"{out_dir} holds a {CONFIG} that is not a mobile-moe run's; choose another --out")
    # A directory with only our config.json is a start that failed before its first epoch: nothing to lose.


def resume_training(run_dir: str | os.PathLike, verbose: bool = True, **changes: Any) -> Path:
    """Continue `run_dir` from checkpoint.pt (or, if it has none yet, start it afresh from its config.json).
    `changes` may only touch how it runs or how long: epochs (not fewer than already done), device, workers,
    compile, eval_batch_size (anything else would make it a different run)."""
    refused = sorted(set(changes) - set(MAY_CHANGE_ON_RESUME))
    if refused:
        raise UsageError(f"--resume keeps the run's settings; cannot change {', '.join(refused)} (start a new --out)")
    check_writable(run_dir, directory=True)
    if not Path(run_dir).is_dir():
        read_config(run_dir)  # its one line: no run there
    with run_lock(run_dir):
        return _resume(Path(run_dir), verbose, changes)


def _resume(run_dir: Path, verbose: bool, changes: dict[str, Any]) -> Path:
    config = read_config(run_dir)
    refuse_resume(config, run_dir)
    check_commit_point(run_dir)
    started = from_dict(config["recipe"])
    cfg = started.replace(**{k: v for k, v in changes.items() if v is not None})
    check_same_draws(started, cfg)
    spec = config["super_classes"]["spec"] if config.get("super_classes") else None
    model_config = config_from_dict(config["model"])
    data_spec, init_from = config["data"]["spec"], config.get("init_from")
    request = TrainRequest(
        model_config, cfg, data_spec, spec, run_dir, verbose=verbose, resume=True, init_from=init_from
    )
    return _train(request)


def recorded_workers(workers: int) -> int:
    """A recipe's `workers` as a run records it: -1 resolved (one per core this process may use), a count as given."""
    return workers if workers >= 0 else effective_workers(-1)


def effective_workers(workers: int) -> int:
    """The DataLoader workers a process runs for a recipe's `workers`: -1 is one per core this process may use, its
    share where torchrun starts several on one machine (LOCAL_WORLD_SIZE), as a run records it; any count is capped
    at those cores, where more would only contend."""
    cores = usable_cores()
    share = max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return share if workers < 0 else min(workers, cores)


def check_same_draws(started: TrainConfig, resumed: TrainConfig) -> None:
    """UsageError when a resume would change what the augmentation's draws depend on: in the workers pipeline each
    DataLoader worker draws from its own seed (torch's base seed + worker id), so the same epoch with another number
    of workers augments other crops and flips, and the resumed run ends with other weights than the run started (the
    device pipeline keys its draws by seed, epoch, rank and step, whatever the workers)."""
    if started.input_pipeline != "workers" or not augment.draws_at_random(started.augmentation):
        return
    workers = recorded_workers(resumed.workers)  # -1 as it resolves here
    if workers != started.workers:
        raise UsageError(
            f"--workers {workers} differs from the run's {started.workers}: with --input-pipeline workers "
            "each worker draws its own augmentations, so the resumed epochs would not be the run's; resume with "
            f"--workers {started.workers} (or leave it out), or start a new --out"
        )


def training_preprocessing(out_dir: Path, resume: bool, init_from: str | os.PathLike | None) -> dict[str, Any]:
    """How a run feeds its images (open_data's mean, std and eval resize overrides): a resumed run as its own record
    says, a run started from a dense run as that run did, any other run as its data spec does (no overrides)."""
    if resume and (out_dir / CONFIG).is_file():
        return preprocessing(read_config(out_dir)["data"], out_dir / CONFIG)
    return upcycling.preprocessing(init_from) if init_from is not None else {}


def check_resumable(state: dict[str, Any], run_config: dict[str, Any], cfg: TrainConfig, path: Path) -> None:
    """checkpoint.pt must be the run that config.json describes (someone may have edited one of them), and a resume
    cannot end before the epochs already done."""
    training_state = ("epoch", "best_top1", "best_epoch", "optimizer", "scheduler", "data", "recipe", "history")
    missing = [key for key in training_state if key not in state]
    if missing:
        raise UsageError(
            f"{path} holds no training state ({', '.join(missing)} missing; e.g. an imported checkpoint), so it cannot "
            "be resumed; train into a new --out"
        )
    mismatches = []
    for key, mine in (("model", state["config"]), ("data", state["data"]), ("recipe", state["recipe"])):
        theirs = run_config[key]
        if not isinstance(mine, dict):
            mismatches.append(f"{LAST}'s {key} is not a record")
            continue
        skip = MAY_CHANGE_ON_RESUME if key == "recipe" else ()
        mismatches += [
            f"{key} {name}={theirs.get(name)!r} in {CONFIG} but {mine.get(name)!r} in {LAST}"
            for name in differing_fields(theirs, mine, skip)
        ]
    if (state.get("super_classes") or None) != run_config.get("super_classes"):
        mismatches.append(f"super_classes differ between {CONFIG} and {LAST}")
    if mismatches:
        raise UsageError(
            f"{path.parent}: {CONFIG} no longer matches {LAST} ({'; '.join(mismatches[:3])}); restore the "
            f"run's {CONFIG} (the checkpoint holds the truth) or start a new --out"
        )
    done = int(state["epoch"])
    if cfg.epochs < done:
        raise UsageError(
            f"--epochs {cfg.epochs}: the run has already trained {counted(done, 'epoch')}; give --epochs {done} or "
            "more (or leave it out)"
        )


START_AFRESH = "resume from a good copy of the run, or start it afresh into a new --out"


def _history(state: dict[str, Any], out_dir: Path) -> list[dict[str, Any]]:
    """The metrics rows a resume continues: the checkpoint's history, checked as metrics rows
    (run_dir.metrics_row_problem), refused in one line if not."""
    history = state["history"]
    problem = metrics_rows_problem(history)
    if problem is not None:
        raise UsageError(f"{out_dir / LAST}: its history {problem}; the file was damaged or edited: {START_AFRESH}")
    return history


@dataclass(frozen=True)
class TrainRequest:
    """One training run to carry out: what to train, on what, into which directory, and how to start it."""

    model_config: ViTConfig
    cfg: TrainConfig
    data_spec: str
    super_class_spec: str | None
    out_dir: Path
    _: KW_ONLY  # the flags: by name only
    verbose: bool = True
    resume: bool = False  # continue from checkpoint.pt (if the run has one) instead of starting afresh
    fit_num_classes: bool = False  # set the model's num_classes from the data's
    init_from: str | os.PathLike | None = None
    notes: tuple[str, ...] = ()  # said on stderr before epoch 1, once the run's inputs passed their checks


@dataclass
class RunData:
    """The data side of a run: the model config (num_classes fitted), data, super-classes, splits and loader."""

    model_config: ViTConfig
    data: Data
    super_classes: SuperClasses | None
    train_set: Dataset
    val_set: Dataset  # this process's shard
    loader: DataLoader
    sampler: DistributedSampler | KeyedBatches  # what takes set_epoch (make_loader)


@dataclass
class RunProgress:
    """Where a run stands: the epochs done, its best validation top-1 so far and every epoch's metrics row."""

    start_epoch: int = 0
    best_top1: float = -1.0
    best_epoch: int = 0
    metrics: list[dict[str, Any]] = field(default_factory=list)

    def record(self, row: dict[str, Any]) -> None:
        self.metrics.append(row)
        if row["val_top1"] > self.best_top1:
            self.best_top1, self.best_epoch = row["val_top1"], row["epoch"]


@dataclass
class Session:
    """Everything the epochs of one run share, once it is set up."""

    request: TrainRequest
    placement: distributed.Placement
    run: RunData
    opt: Optimisation
    ctx: EpochContext
    run_config: dict[str, Any]  # what config.json says
    say: Callable[[str], None]


def _train(request: TrainRequest) -> Path:
    with distributed.process_group(request.cfg.device) as placement:
        return _train_placed(request, placement)  # its frame, which holds the DDP module, ends first


def _train_placed(request: TrainRequest, placement: distributed.Placement) -> Path:
    pipeline = inputs.resolve(request.cfg.input_pipeline, request.cfg.augmentation)
    workers = recorded_workers(request.cfg.workers)
    request = dataclasses.replace(
        request, cfg=request.cfg.replace(input_pipeline=pipeline, workers=workers)
    )  # recorded as resolved
    printing = request.verbose and placement.is_main
    say = (lambda text: print(text, flush=True)) if printing else (lambda text: None)
    if printing and (note := inputs.cost_note(pipeline, placement.device)):
        print(note, file=sys.stderr, flush=True)
    if placement.device.type == "cpu":  # every batch's tensors reuse the last one's pages (host_memory.py)
        per_rank = request.cfg.batch_size // placement.world_size
        host_memory.keep_freed_blocks(host_memory.float_batch_bytes(per_rank, request.model_config.image_size))
    state = _resume_state(request, placement)
    history = _history(state, request.out_dir) if state is not None else []  # checked before the data opens
    run = _open_run_data(request, placement)
    opt, init_entries = _build_optimisation(request, run, placement, state)
    run_config = {
        "model": run.model_config.to_dict(),
        "data": data_record(run.data),
        "super_classes": super_record(request.super_class_spec, run.super_classes),
        "recipe": request.cfg.to_dict(),
        **init_entries,
    }
    announced = upcycling.announcement(init_entries, run.data, run.model_config)
    if state is None and placement.is_main and announced:
        print(announced, flush=True)  # even under --quiet: the run's model is not all the --init-from run's
    progress = _restore_progress(state, history, request.out_dir, opt, say)
    _prepare_run_dir(request.out_dir, run_config, state, placement, say)
    steps_left = (request.cfg.epochs - progress.start_epoch) * len(run.loader)
    session = Session(request, placement, run, opt, _epoch_context(request, run, placement, steps_left),
                      run_config, say)  # fmt: skip
    if state is None and placement.is_main and (warning := request.cfg.short_run_warning()):
        print(warning, file=sys.stderr, flush=True)  # before the first step, once every check has passed
    _train_epochs(session, progress)
    say(f"best val top-1 {100 * progress.best_top1:.2f}%; run in {request.out_dir}")
    return request.out_dir


def _resume_state(request: TrainRequest, placement: distributed.Placement) -> dict[str, Any] | None:
    """The run being resumed: checkpoint.pt is its commit point (commit_epoch); None for a fresh start."""
    last = request.out_dir / LAST
    if not (request.resume and last.is_file()):
        return None
    state = load_checkpoint(last, map_location=placement.device)
    check_resumable(state, read_config(request.out_dir), request.cfg, last)
    return state


def _open_run_data(request: TrainRequest, placement: distributed.Placement) -> RunData:
    """Data and super-classes, checked against the model and recipe; the training loader and the val shard."""
    cfg, model_config = request.cfg, request.model_config
    overrides = training_preprocessing(request.out_dir, request.resume, request.init_from)
    data = open_data(request.data_spec, model_config.image_size, **overrides)
    if request.fit_num_classes:
        model_config = dataclasses.replace(model_config, num_classes=data.num_classes)
    check_model_fits_data(model_config, data)
    super_classes = resolve_super_classes(request.super_class_spec, data, model_config)
    check_super_classes(model_config, super_classes, cfg)
    train_set = inputs.training_split(data, cfg.augmentation, cfg.input_pipeline, placement.device)
    val_set = distributed.shard(materialized(data.split("val")), placement)
    loader, sampler = make_loader(train_set, cfg, placement, inputs.collate(cfg.input_pipeline))
    check_routing_groups(model_config, cfg.batch_size // placement.world_size)
    return RunData(model_config, data, super_classes, train_set, val_set, loader, sampler)


def _build_optimisation(
    request: TrainRequest, run: RunData, placement: distributed.Placement, state: dict[str, Any] | None
) -> tuple[Optimisation, dict[str, Any]]:
    """Model, optimizer, schedule and the module a step runs; -> (them, config.json entries of --init-from)."""
    cfg, model_config = request.cfg, run.model_config
    torch.manual_seed(cfg.seed)  # the same initial weights on every process
    model = build_model(model_config).to(placement.device)
    # From a dense run (--init-from) on a fresh start: its weights (upcycled) and, for a Hard MoE, stage 1 (PCA +
    # k-means); a resume keeps the run's own (checkpoint.pt, config.json).
    init_entries, resumed = {}, read_config(request.out_dir) if state is not None else None
    if model_config.routing == "cluster":
        init_entries = cluster_fit.stage_one(model, request.init_from, run.data, cfg, placement.device, resumed)
    elif request.init_from is not None:
        init_entries = upcycling.start(model, request.init_from, run.data, resumed)
    optimizer = adamw(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = cosine_schedule(optimizer, cfg, len(run.loader))
    step_module: nn.Module = TrainingForward(model, cfg.route_by)
    if placement.distributed:
        device_ids = [placement.device.index] if placement.device.type == "cuda" else None
        # Every expert runs every step, an unchosen one on an empty batch (moe.py), so each trainable parameter gets a
        # gradient and DDP need not search the graph for unused ones; routing by label may leave the router out.
        step_module = nn.parallel.DistributedDataParallel(
            step_module, device_ids=device_ids, find_unused_parameters=cfg.route_by == "label"
        )
    graph_options = compile_options(cfg, placement.device, placement.world_size) if cfg.compile else {}
    if cfg.compile:
        step_module = compile_model(step_module, **graph_options)
    return Optimisation(step_module, model, optimizer, scheduler, cuda_graphs=bool(graph_options)), init_entries


def _restore_progress(
    state: dict[str, Any] | None, history: list[dict[str, Any]], out_dir: Path, opt: Optimisation, say
) -> RunProgress:
    """A fresh run's progress, or the resumed run's: weights, optimizer and schedule loaded, best, and its metrics
    rows (`history`, _history's)."""
    if state is None:
        return RunProgress()
    load_training_state(state, out_dir / LAST, opt.model, opt.optimizer, opt.scheduler)
    start_epoch, best_top1 = int(state["epoch"]), float(state["best_top1"])
    metrics = list(history)
    say(f"resuming {out_dir} after epoch {start_epoch} (best val top-1 {100 * best_top1:.2f}%)")
    return RunProgress(start_epoch, best_top1, int(state["best_epoch"]), metrics)


def _prepare_run_dir(out_dir: Path, run_config, state, placement: distributed.Placement, say) -> None:
    """The run directory (rank 0): a new config.json, or the run being resumed with best.pt and metrics.jsonl
    restored from its checkpoint.pt if a kill left them behind."""
    if not placement.is_main:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir)
    if state is not None:
        for repaired in reconcile(out_dir, state):
            say(f"restored {repaired} from {LAST}")
    write_config(out_dir, run_config)


def _epoch_context(
    request: TrainRequest, run: RunData, placement: distributed.Placement, steps_left: int
) -> EpochContext:
    cfg, super_classes, device = request.cfg, run.super_classes, placement.device
    assignment = (
        augment.assignment_matrix(super_classes.assignment, super_classes.num_super_classes, device)
        if super_classes is not None
        else None
    )
    mixer = augment.batch_mixer(cfg.augmentation, run.data.num_classes)
    batches = inputs.batches(cfg.input_pipeline, cfg.augmentation, run.data, device, mixer)
    context = EpochContext(cfg, placement, batches, assignment, show_progress=request.verbose)
    if request.verbose and placement.is_main:
        context.estimate = lambda seconds, done: say_run_estimate(seconds, steps_left - done)
    return context


def _train_epochs(session: Session, progress: RunProgress) -> None:
    request, run = session.request, session.run
    cfg = request.cfg
    # Per-image experts (Mobile V-MoE's MLPs, a Hard MoE's whole blocks) run the dispatch the log names.
    per_image_experts = run.model_config.routing in ("image", "cluster")
    if session.placement.is_main and progress.start_epoch == 0:
        for note in request.notes:
            print(note, file=sys.stderr, flush=True)
    session.say(
        f"training {run.model_config.name} on {request.data_spec} ({len(run.train_set)} images, "
        f"{run.data.num_classes} classes) on {session.placement.device} x{session.placement.world_size}, "
        f"{counted(cfg.epochs, 'epoch')}, batch {cfg.batch_size}, lr {cfg.lr:.2e}, input {cfg.input_pipeline}"
        + (f", experts: {expert_dispatch(session.placement.device, cfg.amp)}" if per_image_experts else "")
        + f" -> {request.out_dir}"
    )
    warned_collapse = False
    epoch_seconds: list[float] = []
    for epoch in range(progress.start_epoch, cfg.epochs):
        started = time.perf_counter()
        row = _epoch(session, epoch)
        progress.record(row)
        if session.placement.is_main:
            commit_epoch(request.out_dir, _checkpoint(session, progress, row))
            epoch_seconds.append(time.perf_counter() - started - session.ctx.warmup_s)
            session.ctx.warmup_s = 0.0
            session.say(epoch_line(row) + time_left(epoch_seconds, cfg.epochs - epoch - 1))
            warned_collapse = warned_collapse or _warned_collapse(run.model_config, row)


def _warned_collapse(model_config: ViTConfig, row: dict[str, Any]) -> bool:
    """Say (once a run, even under --quiet: its experts sit idle) when the epoch's router sent nearly every image to
    the same experts; -> whether it was said."""
    warning = collapse_warning(row.get("expert_load"), getattr(model_config, "top_k", 1), row["epoch"])
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    return warning is not None


def _epoch(session: Session, epoch: int) -> dict[str, Any]:
    """Train epoch `epoch` (0-based) and evaluate it; -> its metrics row."""
    cfg, run, placement = session.request.cfg, session.run, session.placement
    run.sampler.set_epoch(epoch)
    seed_epoch(cfg.seed, epoch, placement.rank)
    lr = session.opt.optimizer.param_groups[0]["lr"]
    last = session.request.out_dir / LAST
    kept = f"kept {last} from epoch {epoch}" if epoch else "no checkpoint was written yet"
    try:
        stats = train_one_epoch(session.opt, run.loader, session.ctx, epoch=epoch)
    except NonFiniteLoss as error:
        raise UsageError(
            f"training stopped: non-finite {error}; {kept}; "
            "lower the learning rate (--lr) or clip gradients (--set grad_clip=1)"
        ) from None
    except RuntimeError as error:
        worker = worker_failure(error)
        if worker is None:
            raise
        raise UsageError(f"training stopped: {worker}; {kept}; the same command with --resume continues") from None
    assignment = run.super_classes.assignment if run.super_classes is not None else None
    scores = evaluate(session.opt.model, run.val_set, assignment, cfg.eval_batch_size, placement.device, cfg.amp)
    return {
        "epoch": epoch + 1,
        "step": (epoch + 1) * len(run.loader),
        **stats,
        "val_top1": scores["top1"],
        "val_top5": scores["top5"],
        "router_accuracy": scores["router_accuracy"],
        "expert_load": scores.get("expert_load"),
        "val_experts_per_image": scores.get("experts_per_image_mean"),
        "val_dropped": scores.get("dropped"),
        "lr": lr,
        "time": time.time(),
    }


def _checkpoint(session: Session, progress: RunProgress, row: dict[str, Any]) -> dict[str, Any]:
    """checkpoint.pt after the epoch of `row`: the whole training state, the run's records and every row so far."""
    opt = session.opt
    return checkpoint_dict(
        opt.model,
        optimizer=opt.optimizer.state_dict(),
        scheduler=opt.scheduler.state_dict(),
        epoch=row["epoch"],
        best_top1=progress.best_top1,
        best_epoch=progress.best_epoch,
        recipe=session.request.cfg.to_dict(),
        data=session.run_config["data"],
        super_classes=session.run_config.get("super_classes"),
        metrics=row,
        history=list(progress.metrics),
        rng=rng_states(),
    )
