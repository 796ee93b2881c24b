"""Train a figure's cells: every (cell, seed) is an ordinary run directory, trained, resumed or left alone.

    DIR/runs/CELL/seed-S           a `mobile-moe train` run (config.json, checkpoint.pt, best.pt, metrics.jsonl)
    DIR/super-classes/CELL-E{E}.json  super-classes derived from the source cell's seed-0 run (val confusion)

A sweep runs in two phases: first every cell that needs no derived super-classes (the dense models among them),
then, once the source dense run has finished, the super-class files and the cells that use them. A run that has
finished its epochs is never retrained; one that was killed resumes from its checkpoint (bit-exact on CPU), so a
killed sweep started again with the same command continues where it stopped.

Launchers: "local" trains the runs one after another in this process; "submitit" hands each run to Slurm through
submitit (AutoExecutor: Slurm where `srun` exists, else submitit's local executor), each run possibly a multi-GPU job
whose tasks become torchrun-style ranks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evidence.figures import DERIVED, Cell, Figure
from mobile_moe.errors import UsageError
from training.run import epochs_done

LAUNCHERS = ("local", "submitit")


@dataclass(frozen=True)
class Job:
    """Everything a (possibly remote) process needs to train one run: plain data, so submitit can pickle it."""

    cell: str
    seed: int
    run_dir: str
    model: dict[str, Any]  # ViTConfig.to_dict()
    recipe: dict[str, Any]  # TrainConfig.to_dict()
    data: str
    super_classes: str | None  # a spec train() accepts: FILE.json, random:SEED or None


@dataclass
class SlurmOptions:
    gpus_per_cell: int = 0  # 0: CPU jobs; N: one node, N tasks (one DDP rank per GPU)
    partition: str | None = None
    timeout_min: int = 3 * 24 * 60
    extra: dict[str, Any] = field(default_factory=dict)


def run_dir(out: Path, cell: Cell, seed: int) -> Path:
    return out / "runs" / cell.name / f"seed-{seed}"


def super_class_file(out: Path, fig: Figure, num_experts: int) -> Path:
    return out / "super-classes" / f"{fig.source}-E{num_experts}.json"


def make_job(out: Path, fig: Figure, cell: Cell, seed: int, data: str, recipe: dict[str, Any]) -> Job:
    spec = cell.super_classes
    if spec == DERIVED:
        spec = str(super_class_file(out, fig, cell.num_experts))
    return Job(cell.name, seed, str(run_dir(out, cell, seed)), cell.config.to_dict(), recipe, data, spec)


# --- one run ------------------------------------------------------------------------------------------------------


def check_same_run(job: Job) -> None:
    """A run directory already there must be this cell's run: a sweep into a DIR that holds another scale's, data's
    or recipe's runs would otherwise mix them into one table."""
    from training import run
    from training.recipes import MAY_CHANGE_ON_RESUME

    if not run.is_run_dir(job.run_dir):
        return
    config = run.read_config(job.run_dir)
    mine = {**job.recipe}
    theirs = dict(config["recipe"])
    for name in MAY_CHANGE_ON_RESUME:
        mine.pop(name, None)
        theirs.pop(name, None)
    differ = [key for key in sorted(set(job.model) | set(config["model"])) if job.model.get(key) !=
              config["model"].get(key)]  # fmt: skip
    differ += [f"recipe {key}" for key in sorted(set(mine) | set(theirs)) if mine.get(key) != theirs.get(key)]
    if config["data"]["spec"] != job.data:
        differ.append(f"data {config['data']['spec']}")
    if differ:
        raise UsageError(
            f"{job.run_dir} holds a run that is not this sweep's {job.cell} (differs in {', '.join(differ[:4])}); "
            "it was made with other --data, --scale or --epochs: reproduce into a new --out"
        )


def train_job(job: Job, verbose: bool = False) -> str:
    """Train, resume or skip one run; -> "trained", "resumed" or "done". What submitit runs on a cluster node."""
    from mobile_moe.registry import config_from_dict
    from training.recipes import from_dict
    from training.train import resume_training, train

    _join_submitit_ranks()
    recipe = from_dict(job.recipe)
    done = epochs_done(job.run_dir)
    if done >= recipe.epochs:
        return "done"
    if done > 0:
        resume_training(job.run_dir, verbose=verbose, epochs=recipe.epochs, device=recipe.device)
        return "resumed"
    train(config_from_dict(job.model), recipe, job.data, job.super_classes, job.run_dir, verbose=verbose)
    return "trained"


def _join_submitit_ranks() -> None:
    """Inside a submitit job of several tasks, each task becomes a DDP rank through torchrun's variables (which is
    all training reads); outside submitit, or with one task, nothing changes."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return
    import submitit

    if submitit.JobEnvironment().num_tasks > 1:
        # CUDA_VISIBLE_DEVICES is left alone: training picks cuda:LOCAL_RANK itself.
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


# --- launchers ----------------------------------------------------------------------------------------------------


def run_local(jobs: list[Job], log: Callable[[str], None]) -> dict[tuple[str, int], str]:
    """Train the jobs one after another; -> (cell, seed) -> outcome ("trained", ..., or "failed: why")."""
    from training.engine import NonFiniteLoss

    outcomes = {}
    for index, job in enumerate(jobs, 1):
        log(f"[{index}/{len(jobs)}] {job.cell} seed {job.seed}: training into {job.run_dir}")
        try:
            outcomes[(job.cell, job.seed)] = train_job(job)
        except NonFiniteLoss as error:  # one diverging cell is a result, not the end of the sweep
            outcomes[(job.cell, job.seed)] = f"failed: {error}"
    return outcomes


def run_submitit(jobs: list[Job], folder: Path, options: SlurmOptions, log: Callable[[str], None]):
    """Submit every job, wait for all; -> (cell, seed) -> outcome. A failed job is reported, not raised."""
    import submitit

    executor = submitit.AutoExecutor(folder=folder)
    tasks = max(1, options.gpus_per_cell)
    params: dict[str, Any] = {
        "name": "mobile-moe-reproduce",
        "timeout_min": options.timeout_min,
        "nodes": 1,
        "tasks_per_node": tasks,
        "gpus_per_node": options.gpus_per_cell,
        **options.extra,
    }
    if options.partition:
        params["slurm_partition"] = options.partition
    executor.update_parameters(**params)
    submitted = [(job, executor.submit(train_job, job)) for job in jobs]
    log(f"submitted {len(submitted)} runs to {executor.cluster} (logs in {folder})")
    outcomes = {}
    for job, handle in submitted:
        try:
            results = handle.results()  # one per task; rank 0's is the run's
            outcomes[(job.cell, job.seed)] = results[0]
        except Exception as error:  # submitit's FailedJobError carries the job's traceback: keep its last line
            last = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            outcomes[(job.cell, job.seed)] = f"failed: {last} (log: {handle.paths.stderr})"
        log(f"{job.cell} seed {job.seed}: {outcomes[(job.cell, job.seed)]}")
    return outcomes


def launch(jobs: list[Job], launcher: str, out: Path, options: SlurmOptions, log) -> dict[tuple[str, int], str]:
    if not jobs:
        return {}
    if launcher == "local":
        return run_local(jobs, log)
    return run_submitit(jobs, out / "submitit", options, log)


# --- the two phases -----------------------------------------------------------------------------------------------


def derive_super_classes(out: Path, fig: Figure, num_experts: int, log) -> Path:
    """The source cell's seed-0 run's val confusion -> `num_experts` super-classes (spectral clustering), once."""
    from super_class.derive import confusion_from_run
    from super_class.derive import derive_super_classes as derive

    path = super_class_file(out, fig, num_experts)
    if path.exists():
        return path
    source = run_dir(out, fig.cell(fig.source), 0)
    confusion = confusion_from_run(source, split="val", device="auto")
    derive(confusion.matrix, num_experts, "spectral", 0, confusion.class_names, confusion.source).save(path)
    log(f"derived {num_experts} super-classes from {source} -> {path}")
    return path


def sweep(
    fig: Figure,
    out: Path,
    data: str,
    recipes: dict[str, dict[str, Any]],
    seeds: int,
    launcher: str = "local",
    options: SlurmOptions | None = None,
    log: Callable[[str], None] = print,
) -> dict[tuple[str, int], str]:
    """Train every runnable (cell, seed) of `fig`; `recipes[cell.name]` is its TrainConfig dict without the seed.

    -> (cell, seed) -> outcome for the runs of this invocation ("done" for those finished before)."""
    if launcher not in LAUNCHERS:
        raise UsageError(f"--launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    options = options or SlurmOptions()
    runnable = [cell for cell in fig.cells if cell.skip is None]
    if fig.cell(fig.source).skip is not None:
        runnable = [cell for cell in runnable if cell.super_classes != DERIVED]
    jobs = {(cell.name, seed): make_job(out, fig, cell, seed, data, {**recipes[cell.name], "seed": seed})
            for cell in runnable for seed in range(seeds)}  # fmt: skip
    for job in jobs.values():
        check_same_run(job)
    first = [job for key, job in jobs.items() if fig.cell(key[0]).super_classes != DERIVED]
    outcomes = launch(_pending(first), launcher, out, options, log)
    second = [job for key, job in jobs.items() if fig.cell(key[0]).super_classes == DERIVED]
    if second:
        source = run_dir(out, fig.cell(fig.source), 0)
        if epochs_done(source) == 0:
            log(f"no super-classes: the source run {source} did not train; skipping the cells that need them")
            return outcomes
        for experts in sorted({fig.cell(job.cell).num_experts for job in second}):
            derive_super_classes(out, fig, experts, log)
        outcomes.update(launch(_pending(second), launcher, out, options, log))
    return outcomes


def _pending(jobs: list[Job]) -> list[Job]:
    """The jobs whose run has not finished its epochs (finished cells are never retrained, nor even submitted)."""
    return [job for job in jobs if epochs_done(job.run_dir) < job.recipe["epochs"]]


def stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
