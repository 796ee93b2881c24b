"""Run directories (DESIGN.md): what training writes and every later stage reads.

    RUN_DIR/config.json    {"model": ViTConfig.to_dict(), "data": {"spec", "image_size", "mean", "std",
                            "class_names"}, "super_classes": null | {"spec", "names", "assignment"},
                            "recipe": TrainConfig as a dict}
    RUN_DIR/checkpoint.pt  last epoch: {"model", "config", "optimizer", "scheduler", "epoch", "rng", ...}
    RUN_DIR/best.pt        the epoch with the best validation top-1 (same layout)
    RUN_DIR/metrics.jsonl  one JSON object per finished epoch

Everything is written atomically, so a directory either holds a complete file or the previous one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from mobile_moe.atomic import write_text_atomic
from mobile_moe.checkpoint import load_checkpoint, model_from_checkpoint
from mobile_moe.errors import UsageError

CONFIG = "config.json"
LAST = "checkpoint.pt"
BEST = "best.pt"
METRICS = "metrics.jsonl"
CHECKPOINTS = {"best": BEST, "last": LAST}


@dataclass
class Run:
    """A trained run, ready to use: the model in eval mode on CPU and the run's config.json."""

    run_dir: Path
    config: dict[str, Any]
    model: nn.Module
    checkpoint: dict[str, Any]

    @property
    def class_names(self) -> list[str]:
        return list(self.config["data"]["class_names"])

    @property
    def super_assignment(self) -> list[int] | None:
        """assignment[c] = super-class of class c, as used in training; None when the run had no super-classes."""
        super_classes = self.config.get("super_classes")
        return list(super_classes["assignment"]) if super_classes else None

    def open_data(self, spec: str | None = None):
        """The run's data (or `spec`) at the run's image size, normalised with the run's recorded mean and std."""
        from training.data import open_data

        data = self.config["data"]
        return open_data(spec or data["spec"], data["image_size"], mean=data["mean"], std=data["std"])


def is_run_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG).is_file()


def read_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    run_dir = Path(run_dir)
    path = run_dir / CONFIG
    if not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir} does not exist; train one with `mobile-moe train --out {run_dir}`")
    if not path.is_file():
        raise UsageError(f"{run_dir} is not a run directory (no {CONFIG}); pass the --out directory of a training run")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read {path}: {error}") from None
    missing = [key for key in ("model", "data", "recipe") if not isinstance(config, dict) or key not in config]
    if missing:
        raise UsageError(f"{path} is not a run config: missing {', '.join(missing)}")
    return config


def write_config(run_dir: str | os.PathLike, config: dict[str, Any]) -> None:
    write_text_atomic(Path(run_dir) / CONFIG, json.dumps(config, indent=2) + "\n")


def load_run(run_dir: str | os.PathLike, checkpoint: str = "best") -> Run:
    """Load a run: `checkpoint` is "best" (best.pt, falling back to checkpoint.pt) or "last" (checkpoint.pt)."""
    if checkpoint not in CHECKPOINTS:
        raise UsageError(f"checkpoint {checkpoint!r}: choose one of {', '.join(CHECKPOINTS)}")
    run_dir = Path(run_dir)
    config = read_config(run_dir)
    path = run_dir / CHECKPOINTS[checkpoint]
    if not path.is_file() and checkpoint == "best":
        path = run_dir / LAST
    if not path.is_file():
        raise UsageError(f"{run_dir} has no checkpoint yet (no {BEST} or {LAST}); let training finish an epoch")
    state = load_checkpoint(path, map_location="cpu")
    model = model_from_checkpoint(state).eval()
    return Run(run_dir, config, model, state)


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_metrics(run_dir: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """Rewrite metrics.jsonl as a whole (atomically): a resumed run first drops epochs after its checkpoint."""
    write_text_atomic(Path(run_dir) / METRICS, "".join(json.dumps(row) + "\n" for row in rows))
