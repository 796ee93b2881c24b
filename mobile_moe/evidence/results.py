"""A figure's numbers: each finished run evaluated once (cached), costs from the config, mean and std over seeds.

DIR/scores/CELL/seed-S.json   the evaluation of that run's best.pt, with the epochs the run had then (a resumed,
                              longer run is evaluated again)
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch.utils.data import Dataset

from mobile_moe.data.datasets import materialized
from mobile_moe.errors import UsageError
from mobile_moe.evidence.figures import Cell, Figure
from mobile_moe.evidence.sweep import run_dir
from mobile_moe.models.costs import costs
from mobile_moe.training.evaluate import evaluate
from mobile_moe.training.run_dir import epochs_done, load_run
from mobile_moe.utils.atomic import write_text_atomic

SCORED = ("top1", "router_accuracy", "experts_per_image_mean")  # what evaluate() reports that the tables use


@dataclass
class CellResult:
    cell: Cell
    seeds: list[dict[str, Any]] = field(default_factory=list)  # one evaluation per finished seed
    status: str = "ok"  # "ok", or why there is no number (skipped, pending, failed)
    costs: dict[str, int] = field(default_factory=dict)  # params_total, params_active, flops
    bench: dict[str, Any] = field(default_factory=dict)  # p50_ms, peak_rss_bytes, bytes_loaded_per_image

    def mean(self, key: str) -> float | None:
        values = [s[key] for s in self.seeds if s.get(key) is not None]
        return statistics.fmean(values) if values else None

    def std(self, key: str) -> float | None:
        """Sample standard deviation over seeds (None for fewer than two)."""
        values = [s[key] for s in self.seeds if s.get(key) is not None]
        return statistics.stdev(values) if len(values) > 1 else None


class ScoreRecord(BaseModel):
    """DIR/scores/CELL/seed-S.json: written from this model and read back through it (strictly), so a record that
    was edited, damaged or replaced is evaluated again, never reported."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(ge=0)
    checkpoint: tuple[int, int]  # checkpoint_stamp of the best.pt evaluated
    epochs_done: int = Field(ge=0)
    split: Literal["test", "val"]
    images: int = Field(ge=1)
    top1: float = Field(ge=0, le=1)
    router_accuracy: float | None = Field(ge=0, le=1)
    experts_per_image_mean: float | None = Field(ge=0)


def checkpoint_stamp(run: Path) -> tuple[int, int]:
    """best.pt's size and modification time: a run trained again (or further) into the same directory has another."""
    stat = (run / "best.pt").stat()
    return stat.st_size, stat.st_mtime_ns


def _cached(path: Path, stamp: tuple[int, int]) -> dict[str, Any] | None:
    """The score record at `path` if it is ours, valid and of this best.pt; None to evaluate again. What stands there
    and is no regular file (a directory, a FIFO that would block the read) is refused: it is not ours to replace."""
    if not path.exists():
        return None
    if not path.is_file():
        raise UsageError(f"{path} is not a regular file, so not a score record of ours; move it away and run again")
    try:
        record = ScoreRecord.model_validate_json(path.read_bytes(), strict=True)
    except (OSError, ValidationError):
        return None  # damaged or edited: evaluate again
    return record.model_dump() if record.checkpoint == stamp else None


class EvaluationSplits:
    """Each data record's evaluation split (test; val where the data has no test images), opened and computed once
    for every run that shares it, as a sweep's runs do: opening Fashion-MNIST and stretching its 10,000 test images
    costs seconds, as much as evaluating a small model on a GPU."""

    def __init__(self) -> None:
        self._splits: dict[str, tuple[str, Dataset]] = {}

    def of(self, run) -> tuple[str, Dataset]:
        """-> (split name, its items) for `run` (a training.run_dir.Run), fed as the run records."""
        key = json.dumps(run.config["data"], sort_keys=True)
        if key not in self._splits:
            data = run.open_data()
            split = "test" if len(data.split("test")) else "val"
            self._splits[key] = split, materialized(data.split(split))
        return self._splits[key]


def evaluate_run(out: Path, cell: Cell, seed: int, done: int, device: str, splits: EvaluationSplits) -> dict[str, Any]:
    """The run's best.pt on its data's evaluation split (EvaluationSplits); cached. `done`: the epochs the run has
    (recorded with the scores)."""
    path = run_dir(out, cell, seed)
    stamp = checkpoint_stamp(path)
    cache = out / "scores" / cell.name / f"seed-{seed}.json"
    cached = _cached(cache, stamp)
    if cached is not None:
        return cached
    run = load_run(path)
    split, dataset = splits.of(run)
    scores = evaluate(run.model.to(device), dataset, run.super_assignment, device=device)
    record = ScoreRecord(seed=seed, checkpoint=stamp, epochs_done=done, split=split, images=scores["images"],
                         **{key: scores.get(key) for key in SCORED})  # fmt: skip
    write_text_atomic(cache, record.model_dump_json(indent=1) + "\n")  # makes its folders, or says in one line why not
    return record.model_dump()


def collect(
    fig: Figure, out: Path, seeds: int, epochs: dict[str, int], outcomes: dict, device: str
) -> list[CellResult]:
    """One CellResult per cell; `epochs[cell]` is what a finished run has, `outcomes` what this sweep reported."""
    results, splits = [], EvaluationSplits()
    for cell in fig.cells:
        result = CellResult(cell)
        if cell.skip is not None:
            result.status = f"n/a: {cell.skip}"
            results.append(result)
            continue
        result.costs = vars(costs(cell.config))
        failed = [f"seed {seed}: {outcomes[(cell.name, seed)]}" for seed in range(seeds)
                  if str(outcomes.get((cell.name, seed), "")).startswith("failed")]  # fmt: skip
        done = {seed: epochs_done(run_dir(out, cell, seed)) for seed in range(seeds)}
        finished = [seed for seed in range(seeds) if done[seed] >= epochs[cell.name]]
        lost = [seed for seed in finished if not (run_dir(out, cell, seed) / "best.pt").is_file()]
        failed += [f"seed {seed}: finished, but {run_dir(out, cell, seed) / 'best.pt'} is gone" for seed in lost]
        finished = [seed for seed in finished if seed not in lost]
        result.seeds = [evaluate_run(out, cell, seed, done[seed], device, splits) for seed in finished]
        if failed:
            result.status = "; ".join(failed)
        elif len(finished) < seeds:
            result.status = f"pending: {len(finished)} of {seeds} seeds finished"
        results.append(result)
    return results
