"""A figure's numbers: each finished run evaluated once (cached), costs from the config, mean and std over seeds.

DIR/scores/CELL/seed-S.json   the evaluation of that run's best.pt, with the epochs the run had then (a resumed,
                              longer run is evaluated again)
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mobile_moe.atomic import write_text_atomic
from mobile_moe.costs import costs
from mobile_moe.evidence.figures import Cell, Figure
from mobile_moe.evidence.sweep import run_dir
from mobile_moe.training.evaluate import evaluate
from mobile_moe.training.run_dir import epochs_done, load_run

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


def checkpoint_stamp(run: Path) -> list[int]:
    """best.pt's size and modification time: a run trained again (or further) into the same directory has another."""
    stat = (run / "best.pt").stat()
    return [stat.st_size, stat.st_mtime_ns]


def _cached(path: Path, stamp: list[int]) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # absent or damaged: evaluate again
    return record if isinstance(record, dict) and record.get("checkpoint") == stamp else None


def evaluate_run(out: Path, cell: Cell, seed: int, done: int, device: str) -> dict[str, Any]:
    """The run's best.pt on the data's test split (val where the data has no test images); cached. `done`: the
    epochs the run has (recorded with the scores)."""
    path = run_dir(out, cell, seed)
    stamp = checkpoint_stamp(path)
    cache = out / "scores" / cell.name / f"seed-{seed}.json"
    record = _cached(cache, stamp)
    if record is not None:
        return record
    run = load_run(path)
    data = run.open_data()
    split = "test" if len(data.split("test")) else "val"
    scores = evaluate(run.model.to(device), data.split(split), run.super_assignment, device=device)
    record = {"seed": seed, "checkpoint": stamp, "epochs_done": done, "split": split,
              "images": scores["images"]}  # fmt: skip
    record.update({key: scores.get(key) for key in SCORED})
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(cache, json.dumps(record, indent=1) + "\n")
    return record


def collect(
    fig: Figure, out: Path, seeds: int, epochs: dict[str, int], outcomes: dict, device: str
) -> list[CellResult]:
    """One CellResult per cell; `epochs[cell]` is what a finished run has, `outcomes` what this sweep reported."""
    results = []
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
        result.seeds = [evaluate_run(out, cell, seed, done[seed], device) for seed in finished]
        if failed:
            result.status = "; ".join(failed)
        elif len(finished) < seeds:
            result.status = f"pending: {len(finished)} of {seeds} seeds finished"
        results.append(result)
    return results
