"""Train a figure's cells: every (cell, seed) is an ordinary run directory, trained, resumed or left alone.

    DIR/runs/CELL/seed-S           a `mobile-moe train` run (config.json, checkpoint.pt, best.pt, metrics.jsonl)
    DIR/super-classes/CELL-E{E}.json  super-classes derived from the source cell's seed-0 run (val confusion)

A sweep runs in two phases: first every cell that needs no derived super-classes (the dense models among them),
then, once the source dense run has finished, the super-class files and the cells that use them. A run that has
finished its epochs is never retrained; one that was killed resumes from its checkpoint (bit-exact on CPU), so a
killed sweep started again with the same command continues where it stopped.

Launchers: "local" trains the runs one after another in this process, or --jobs N of them at a time in worker
processes (small runs side by side on one GPU); "submitit" hands each run to Slurm through
submitit (AutoExecutor: Slurm where `srun` exists, else submitit's local executor), each run possibly a multi-GPU job
whose tasks become torchrun-style ranks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mobile_moe.errors import UsageError
from mobile_moe.evidence.figures import DERIVED, Cell, Figure
from mobile_moe.evidence.launch import LAUNCHERS, SlurmOptions
from mobile_moe.formats.superclasses import load
from mobile_moe.models.registry import config_from_dict
from mobile_moe.training.engine import NonFiniteLoss
from mobile_moe.training.evaluate import confusion_from_run
from mobile_moe.training.recipes import from_dict
from mobile_moe.training.run_dir import differences, epochs_done, holds_results, is_run_dir, read_config, repair_commit
from mobile_moe.training.train import resume_training, train
from mobile_moe.utils.devices import usable_cores
from mobile_moe.utils.words import counted


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
    """A run directory already there must be this cell's run, trained no longer than asked: a sweep into a DIR that
    holds another scale's, data's or recipe's runs would mix them into one table, and a run of 20 epochs is not the
    answer to --epochs 5."""
    if not is_run_dir(job.run_dir):
        return
    config = read_config(job.run_dir)
    differ = differences(config, job.model, job.recipe, job.data)
    differ += ["super-classes"] if _other_super_classes(config.get("super_classes"), job.super_classes) else []
    if differ:
        raise UsageError(
            f"{job.run_dir} holds a run that is not this sweep's {job.cell} (differs in {', '.join(differ[:4])}); "
            "it was made with other --data or --scale: reproduce into a new --out"
        )
    done, asked = epochs_done(job.run_dir), job.recipe["epochs"]
    if done > asked:
        raise UsageError(
            f"{job.run_dir} has trained {counted(done, 'epoch')}, more than --epochs {asked}; give --epochs {done} or "
            "more (or leave it out), or reproduce into a new --out"
        )


def _other_super_classes(theirs: dict[str, Any] | None, spec: str | None) -> bool:
    """Whether a run trained with `theirs` (its config's record) is not one trained with `spec`. A derived file is
    compared by its assignment, so a sweep DIR that was moved or copied still holds its own runs."""
    if theirs is None or spec is None:
        return (theirs is None) != (spec is None)
    if Path(spec).is_file():
        return load(spec).assignment != theirs.get("assignment")
    return spec != theirs.get("spec")


def train_job(job: Job, verbose: bool = False) -> str:
    """Train, resume or skip one run; -> "trained", "resumed" or "done". What submitit runs on a cluster node."""
    _join_submitit_ranks()
    recipe = from_dict(job.recipe)
    done = epochs_done(job.run_dir)
    if done >= recipe.epochs:
        return "done"
    if done == 0 and holds_results(job.run_dir):
        raise UsageError(
            f"{job.run_dir}/checkpoint.pt is missing or unreadable although the run has results; move that run "
            "directory aside to train it again"
        )
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


def train_or_fail(job: Job) -> str:
    """train_job's outcome, or "failed: why" for a run that diverged or was refused: one such run is not the end of
    the sweep."""
    try:
        return train_job(job)
    except (NonFiniteLoss, UsageError) as error:
        return f"failed: {error}"


def run_local(jobs: list[Job], log: Callable[[str], None]) -> dict[tuple[str, int], str]:
    """Train the jobs one after another; -> (cell, seed) -> outcome ("trained", ..., or "failed: why")."""
    outcomes = {}
    for index, job in enumerate(jobs, 1):
        log(f"[{index}/{len(jobs)}] {job.cell} seed {job.seed}: training into {job.run_dir}")
        outcome = outcomes[(job.cell, job.seed)] = train_or_fail(job)
        if outcome.startswith("failed"):
            log(f"{job.cell} seed {job.seed}: {outcome}")
    return outcomes


def run_side_by_side(jobs: list[Job], processes: int, log: Callable[[str], None]) -> dict[tuple[str, int], str]:
    """Train the jobs `processes` at a time, each run in a process of its own, sharing this machine's cores and its
    one device: a small model's run leaves most of a GPU idle between its kernels, so several runs fill it.

    Processes are spawned (a forked process cannot use CUDA), each with an equal share of the cores for its threads.
    A run whose process dies (a signal, the OOM killer) is a failed row, as a diverged one is; an interrupted sweep
    stops every run it started, and each resumes from its last epoch when the sweep is started again."""
    import multiprocessing
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("spawn")
    reports = context.SimpleQueue()
    threads = max(1, usable_cores() // processes)
    waiting, running, reported, outcomes = list(jobs), {}, {}, {}
    log(f"training {len(jobs)} runs, {processes} at a time ({threads} threads each)")
    try:
        while waiting or running:
            while waiting and len(running) < processes:
                job = waiting.pop(0)
                process = context.Process(target=_train_in_process, args=(job, threads, processes, reports),
                                          name=f"{job.cell}-seed-{job.seed}")  # fmt: skip
                process.start()
                running[(job.cell, job.seed)] = process
            wait([process.sentinel for process in running.values()])
            for key, outcome in _ended(running, reports, reported):
                outcomes[key] = outcome
                log(f"[{len(outcomes)}/{len(jobs)}] {key[0]} seed {key[1]}: {outcome}")
    finally:
        for process in running.values():  # only when interrupted: a finished sweep has none left
            process.terminate()
            process.join()
    return outcomes


def _train_in_process(job: Job, threads: int, processes: int, reports) -> None:
    if sys.platform == "linux":  # a parent killed outright (SIGKILL) takes its runs with it: PR_SET_PDEATHSIG
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    import torch

    from mobile_moe.data import datasets as data

    torch.set_num_threads(threads)
    data.share_memory_with(processes)
    try:
        reports.put(((job.cell, job.seed), train_or_fail(job)))
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the sweep: its parent says "interrupted", once
        sys.exit(130)


def _ended(running: dict[tuple[str, int], Any], reports, reported: dict) -> list[tuple[tuple[str, int], str]]:
    """Remove the processes that have ended from `running`; -> their (cell, seed) and outcome. `reported` keeps the
    reports read so far (a process reports just before it exits), so an ended process without one died."""
    # Which processes ended, THEN their reports: a process that reports and exits between the two steps would
    # otherwise be found ended with its report still unread. (A process's queue is flushed before it exits.)
    ended_keys = [key for key, process in running.items() if not process.is_alive()]
    while not reports.empty():
        key, outcome = reports.get()
        reported[key] = outcome
    ended = []
    for key in ended_keys:
        process = running.pop(key)
        process.join()
        ended.append((key, reported.pop(key, f"failed: its process ended (exit code {process.exitcode}) first")))
    return ended


def run_submitit(jobs: list[Job], folder: Path, options: SlurmOptions, log: Callable[[str], None]):
    """Submit the jobs and wait for them; -> (cell, seed) -> outcome. A failed job is reported, not raised.

    On Slurm every job is queued at once; submitit's local executor (no Slurm here) would start them all at once on
    this machine, so there each job is submitted when the previous one has ended."""
    import submitit

    executor = submitit.AutoExecutor(folder=folder)
    executor.update_parameters(**slurm_parameters(options))
    log(f"submitting {len(jobs)} runs to {executor.cluster} (logs in {folder})")
    if executor.cluster == "local":  # lazily: each job is submitted when the loop has waited for the one before
        handles = (executor.submit(train_job, job) for job in jobs)
    else:
        handles = [executor.submit(train_job, job) for job in jobs]
    outcomes: dict[tuple[str, int], str] = {}
    for job, handle in zip(jobs, handles, strict=True):
        outcomes[(job.cell, job.seed)] = _job_outcome(handle)
        log(f"{job.cell} seed {job.seed}: {outcomes[(job.cell, job.seed)]}")
    return outcomes


def slurm_parameters(options: SlurmOptions) -> dict[str, Any]:
    """AutoExecutor parameters: one node, a task (DDP rank) per GPU; GPUs only when asked for (sbatch refuses
    --gpus-per-node=0 where no GPUs are configured)."""
    params: dict[str, Any] = {
        "name": "mobile-moe-reproduce",
        "timeout_min": options.timeout_min,
        "nodes": 1,
        "tasks_per_node": max(1, options.gpus_per_cell),
        "cpus_per_task": options.cpus_per_task,
    }
    if options.gpus_per_cell:
        params["gpus_per_node"] = options.gpus_per_cell
    if options.partition:
        params["slurm_partition"] = options.partition
    return {**params, **options.extra}


def _job_outcome(handle) -> str:
    try:
        return handle.results()[0]  # one result per task; rank 0's is the run's
    except Exception as error:  # submitit's FailedJobError carries the job's traceback: keep its last line
        text = str(error).strip()
        return f"failed: {text.splitlines()[-1] if text else type(error).__name__} (log: {handle.paths.stderr})"


def launch(jobs: list[Job], launcher: str, out: Path, options: SlurmOptions, log,
           side_by_side: int = 1) -> dict[tuple[str, int], str]:  # fmt: skip
    if not jobs:
        return {}
    if launcher == "local" and side_by_side > 1:
        return run_side_by_side(jobs, min(side_by_side, len(jobs)), log)
    if launcher == "local":
        return run_local(jobs, log)
    return run_submitit(jobs, out / "submitit", options, log)


# --- the two phases -----------------------------------------------------------------------------------------------


def derive_super_classes(out: Path, fig: Figure, num_experts: int, device: str, log) -> Path:
    """The source cell's seed-0 run's val confusion -> `num_experts` super-classes (spectral clustering), once: runs
    record the file they trained with and a resume re-reads it, so it never changes under them (not even when more
    --epochs extend the source run)."""
    # scikit-learn, scipy and networkx (a second's start-up) load only when a sweep clusters
    from mobile_moe.super_class.derive import derive_super_classes as derive

    path = super_class_file(out, fig, num_experts)
    if path.exists():
        return path
    source = run_dir(out, fig.cell(fig.source), 0)
    confusion = confusion_from_run(source, split="val", device=device)
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
    side_by_side: int = 1,
) -> dict[tuple[str, int], str]:
    """Train every runnable (cell, seed) of `fig`; `recipes[cell.name]` is its TrainConfig dict without the seed;
    the local launcher trains `side_by_side` runs at a time.

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
    outcomes = launch(_pending(first, log), launcher, out, options, log, side_by_side)
    second = [job for key, job in jobs.items() if fig.cell(key[0]).super_classes == DERIVED]
    if second:
        source = jobs[(fig.source, 0)]
        if epochs_done(source.run_dir) < source.recipe["epochs"]:
            log(
                f"no super-classes: the source run {source.run_dir} has not finished; skipping the cells that need them"
            )
            return outcomes
        for experts in sorted({fig.cell(job.cell).num_experts for job in second}):
            derive_super_classes(out, fig, experts, source.recipe["device"], log)
        outcomes.update(launch(_pending(second, log), launcher, out, options, log, side_by_side))
    return outcomes


def _pending(jobs: list[Job], log: Callable[[str], None] = print) -> list[Job]:
    """The jobs whose run has not finished its epochs (finished cells are never retrained, nor even submitted); a
    finished run an interrupt left half-committed (checkpoint.pt written, best.pt not yet) is repaired first."""
    pending = []
    for job in jobs:
        if epochs_done(job.run_dir) < job.recipe["epochs"]:
            pending.append(job)
        else:
            for repaired in repair_commit(job.run_dir):
                log(f"{job.run_dir}: restored {repaired} from its checkpoint.pt (an interrupt came between the two)")
    return pending


def stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
