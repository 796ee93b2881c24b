"""Run directories (docs/formats.md): what training writes and every later stage reads.

    RUN_DIR/config.json    {"version": 1, "model": ViTConfig.to_dict(), "data": {"spec", "image_size", "mean", "std",
                            "class_names", "eval_resize"}, "super_classes": null | {"spec", "names", "assignment"},
                            "recipe": TrainConfig as a dict}
    RUN_DIR/checkpoint.pt  last epoch: {"version": 1, "model", "config", "optimizer", "scheduler", "epoch", "rng",
                            "best_epoch", "best_top1", "metrics" (this epoch's row), "history" (every epoch's row so
                            far), ...}
    RUN_DIR/best.pt        the epoch with the best validation top-1 (same layout)
    RUN_DIR/metrics.jsonl  one JSON object per finished epoch

The run's format version (models.checkpoint.RUN_VERSION) is config.json's "version", which covers every file of the
directory, and each checkpoint states it too: a run of another version is refused by read_config (a checkpoint by
load_checkpoint) in one line.

Everything is written atomically, so a directory either holds a complete file or the previous one. An epoch is
committed by checkpoint.pt (`commit_epoch`); best.pt and metrics.jsonl follow it and are derived from it, so after a
kill anywhere `reconcile` (run by a resume) restores them: the run directory then holds exactly what an
uninterrupted run writes.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from mobile_moe.data.datasets import open_data
from mobile_moe.data.spec_options import same_data
from mobile_moe.errors import UsageError
from mobile_moe.formats.versions import check_version
from mobile_moe.models.checkpoint import RUN_VERSION, load_checkpoint, model_from_checkpoint, save_checkpoint
from mobile_moe.preprocess import check_resize
from mobile_moe.training import distributed
from mobile_moe.training.recipes import MAY_CHANGE_ON_RESUME, matches_record
from mobile_moe.training.super_spec import super_record_problem
from mobile_moe.utils import atomic
from mobile_moe.utils.atomic import process_description, write_text_atomic
from mobile_moe.utils.class_names import check_classes, class_names_problem
from mobile_moe.utils.foreign_files import read_foreign_text
from mobile_moe.utils.words import shown

CONFIG = "config.json"
MAX_RECORD_BYTES = 256 << 20  # config.json and metrics.jsonl: kilobytes a run (a row an epoch); refuse a giant
LAST = "checkpoint.pt"
BEST = "best.pt"
METRICS = "metrics.jsonl"
CHECKPOINTS = {"best": BEST, "last": LAST}
RESULTS = (LAST, BEST, METRICS)  # what only a run that finished an epoch holds


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
    def metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl: one row per epoch finished (train loss, val top-1, router accuracy, ...)."""
        return read_metrics(self.run_dir)

    @property
    def super_assignment(self) -> list[int] | None:
        """assignment[c] = super-class of class c, as used in training; None when the run had no super-classes."""
        super_classes = self.config.get("super_classes")
        return list(super_classes["assignment"]) if super_classes else None

    def open_data(self, spec: str | None = None):
        """The run's data (or `spec`, which must have the run's classes) at the run's image size, fed as the run
        records (`preprocessing`)."""
        record = self.config["data"]
        spec = spec or record["spec"]
        if spec is None:
            source = self.config["source"]["model"]
            raise UsageError(f"{self.run_dir} was imported from {source} and has no data of its own; give --data SPEC")
        data = open_data(spec, record["image_size"], **preprocessing(record, self.run_dir / CONFIG))
        check_classes(
            self.class_names,
            data,
            whose=f"the run in {self.run_dir}",
            fix=f"use data with the run's classes, or fine-tune it on yours first (mobile-moe train --model vit "
            f"--init-from RUN_DIR --data {data.spec} --out NEW_RUN)",
        )
        return data


def preprocessing(record: dict[str, Any], where: str | os.PathLike) -> dict[str, Any]:
    """open_data's overrides that feed images as a run's data record says: its mean, std and eval resize policy
    (checked here, so a bad record names the file `where` it came from)."""
    resize = check_resize(record["eval_resize"], record["image_size"], f"{where} data.eval_resize")
    return {"mean": record["mean"], "std": record["std"], "eval_resize": resize}


def is_imported(config: dict[str, Any]) -> bool:
    """A run `mobile-moe import` wrote (mobile_moe/training/imported.py): a source, no recipe, no data spec, no training
    state."""
    return isinstance(config.get("source"), dict)


def is_run_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG).is_file()


def holds_results(path: str | os.PathLike) -> bool:
    """True once a run has finished an epoch; a directory with only config.json is a failed start."""
    return any((Path(path) / name).exists() for name in RESULTS)


def _near_runs(missing: Path) -> list[Path]:
    """Run directories whose paths are close to `missing`, closest first, at most two: a typo in any component below
    the deepest folder that exists ("rnus/moe" finds runs/moe, "runs/mo" finds runs/moe)."""
    existing, typed = missing, []
    while not os.path.isdir(existing) and existing != existing.parent:  # False, not OSError, for a name too long
        typed.insert(0, existing.name)
        existing = existing.parent
    return _close_paths(existing, typed)[:2] if typed else []


def _close_paths(folder: Path, names: list[str]) -> list[Path]:
    """Paths under `folder` whose components are close to `names` in turn (at most two per step), ending in a run."""
    last = len(names) == 1
    try:
        entries = [entry.name for entry in folder.iterdir() if ((entry / CONFIG).is_file() if last else entry.is_dir())]
    except OSError:
        return []
    close = difflib.get_close_matches(names[0], entries, n=2, cutoff=0.6)
    if last:
        return [folder / name for name in close]
    return [path for name in close for path in _close_paths(folder / name, names[1:])]


def read_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    run_dir = Path(run_dir)
    path = run_dir / CONFIG
    if run_dir.is_file():
        raise UsageError(
            f"{run_dir} is a file, not a run directory; pass the directory that holds it ({run_dir.parent})"
        )
    if not run_dir.is_dir():
        near = _near_runs(run_dir)
        if near:
            raise UsageError(f"run directory {run_dir} does not exist; did you mean {' or '.join(map(str, near))}?")
        raise UsageError(f"run directory {run_dir} does not exist; train one with `mobile-moe train --out {run_dir}`")
    if not path.is_file():
        raise UsageError(f"{run_dir} is not a run directory (no {CONFIG}); pass the --out directory of a training run")
    try:
        config = json.loads(read_foreign_text(path, limit=MAX_RECORD_BYTES, what=CONFIG))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise UsageError(f"cannot read {path}: {error}") from None
    missing = [key for key in ("model", "data", "recipe") if not isinstance(config, dict) or key not in config]
    if isinstance(config, dict) and ("version" in config or not missing):  # a run's config.json: its version first
        fix = f"{'import' if is_imported(config) else 'train'} it again into a new --out"
        check_version(config, RUN_VERSION, where=str(path), what="a run", fix=fix)
    if missing:
        raise UsageError(f"{path} is not a run config: missing {', '.join(missing)}")
    imported = is_imported(config)  # a source instead of a recipe and a data spec
    wrong = [key for key in ("model", "data") if not isinstance(config[key], dict)]
    wrong += [] if isinstance(config["recipe"], dict) or (imported and config["recipe"] is None) else ["recipe"]
    wrong += [] if isinstance(config.get("super_classes"), dict | None) else ["super_classes"]
    spec = config["data"].get("spec", "") if isinstance(config["data"], dict) else ""
    wrong += [] if isinstance(spec, str) or (imported and spec is None) else ["data.spec"]
    if wrong:
        raise UsageError(f"{path} is not a run config: {', '.join(wrong)} has the wrong type; was it edited?")
    problem = data_record_problem(config["data"]) or (
        "source.model is not a name" if imported and not isinstance(config["source"].get("model"), str) else None
    )
    if problem is None and config.get("super_classes") is not None:
        experts = config["model"].get("num_experts")
        problem = super_record_problem(config["super_classes"], config["data"]["class_names"], experts)
    if problem:
        raise UsageError(f"{path} is damaged: {problem}; was it edited? restore it or re-create the run")
    return config


def data_record_problem(record: dict[str, Any]) -> str | None:
    """The first way a config.json "data" record (data.data_record) cannot feed a model, or None."""
    import math

    def numbers(value: Any, positive: bool) -> bool:
        return (
            isinstance(value, list)
            and len(value) == 3
            and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)
            and (not positive or all(v > 0 for v in value))
        )

    size, names = record.get("image_size"), record.get("class_names")
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        return f"data.image_size {size!r} is not a positive integer"
    if not numbers(record.get("mean"), positive=False) or not numbers(record.get("std"), positive=True):
        return "data.mean and data.std must be 3 finite numbers each (std above 0)"
    problem = class_names_problem(names)
    if problem is not None:
        return f"data.class_names: {problem}"
    if "eval_resize" not in record:
        return "data.eval_resize is missing"
    return None


@contextlib.contextmanager
def run_lock(run_dir: str | os.PathLike) -> Iterator[None]:
    """Hold `run_dir` while this process writes the run in it (train, resume; under torchrun the rank that writes,
    rank 0): a second command into it meanwhile is refused in one line that names the holder. The lock is flock(2)
    on the directory itself, so no lock file is left behind and the kernel releases it when the holder ends, a kill
    included. A directory made here for the run and still empty when the run fails is removed again."""
    if distributed.env_rank() != 0:
        yield
        return
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = os.open(run_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"{run_dir} is being written by {_lock_holder(handle)} right now; wait for it to finish or choose "
                "another --out"
            ) from None
        yield
    finally:
        os.close(handle)  # releases the lock
        if created:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # only if still empty: a refused or failed first start leaves nothing


def _lock_holder(handle: int) -> str:
    """'another mobile-moe command (pid N: its command line)' from /proc/locks where the OS has it (Linux)."""
    stat = os.fstat(handle)
    file_id = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"  # as fs/locks.c prints it
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if fields[1] == "FLOCK" and fields[5] == file_id:  # the same inode on another file system is not ours
                return process_description(int(fields[4]))
    return "another mobile-moe command"


def is_failed_start(path: str | os.PathLike) -> bool:
    """A directory holding our config.json and no results: a start that failed before its first epoch, which may
    be started afresh. A config.json that is not a run config is someone else's file, never overwritten."""
    if holds_results(path) or not (Path(path) / CONFIG).exists():
        return False
    try:
        read_config(path)
    except UsageError:
        return False
    return True


def write_config(run_dir: str | os.PathLike, config: dict[str, Any]) -> None:
    """config.json, stating the run format's version first."""
    record = {"version": RUN_VERSION, **{key: value for key, value in config.items() if key != "version"}}
    write_text_atomic(Path(run_dir) / CONFIG, json.dumps(record, indent=2) + "\n")


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
    check_same_model(str(run_dir), config, state, path.name)
    model = model_from_checkpoint(state, path).eval()
    return Run(run_dir, config, model, state)


def check_same_model(label: str, config: dict[str, Any], state: dict[str, Any], checkpoint: str) -> None:
    """config.json's model and the checkpoint's must be one: a run whose files disagree (an edited config.json, a
    checkpoint copied in from another run) would otherwise be evaluated, exported or grown from as whichever the
    checkpoint holds, silently. `label` names the run in the one line."""
    recorded = state.get("config")
    differ = differing_fields(config["model"], recorded) if isinstance(recorded, dict) else ["all"]
    if differ:
        raise UsageError(
            f"{label}: {CONFIG} and {checkpoint} describe different models ({', '.join(differ[:3])} differ); restore "
            f"the run's {CONFIG} (the checkpoint holds the truth)"
        )


REWRITTEN_ON_RESUME = f"it is rewritten from {LAST} by --resume"  # read_metrics' advice where history is kept


def read_metrics(run_dir: str | os.PathLike, fix: str = REWRITTEN_ON_RESUME) -> list[dict[str, Any]]:
    """metrics.jsonl's rows, each checked (metrics_row_problem); [] without the file. A file that cannot be read or
    holds a row that is not one is one UsageError line, which ends in `fix` (what the reader's user can do)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    try:
        text = read_foreign_text(path, limit=MAX_RECORD_BYTES, what=METRICS)
        lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
        rows = [(number, json.loads(line)) for number, line in lines]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else error
        raise UsageError(f"cannot read {path}: {reason}; {fix}") from None
    problem = next((f"line {number}: {why}" for number, row in rows if (why := metrics_row_problem(row))), None)
    if problem is not None:
        raise UsageError(f"{path} is damaged ({problem}); {fix}")
    return [row for _, row in rows]


# A metrics.jsonl row (docs/formats.md), as training writes it (train._epoch, engine, evaluate) and as it is read back
# from metrics.jsonl or from checkpoint.pt's "history": metrics_row_problem is the one check of it. Training writes
# every field of the table in docs/formats.md; a field not named here may hold any JSON value.
METRICS_COUNTS = ("epoch", "step", "device_refused")  # integers: epoch >= 1 (1-based), the others >= 0
METRICS_LISTS = ("train_expert_load", "expert_load")  # lists of numbers
METRICS_NULLABLE = ("router_accuracy", "expert_load", "val_experts_per_image", "val_dropped")  # also null
METRICS_NUMBERS = (
    *(f"train_{term}" for term in ("loss", "class_loss", "router_loss", "balance_loss", "aux_loss")),
    *("train_experts_per_image", "train_dropped", "train_top1", "images_per_s", "steady_images_per_s"),
    *("epoch_time_s", "input_wait"),
    *("val_top1", "val_top5", "router_accuracy", "val_experts_per_image", "val_dropped", "lr", "time"),
)


def metrics_row_problem(row: Any) -> str | None:
    """The first way `row` is not a metrics.jsonl row, or None: a JSON object with an integer epoch >= 1, each field
    of METRICS_* of its type where present, and JSON values only (metrics.jsonl is rewritten from such rows)."""
    if not isinstance(row, dict):
        return f"a row is {_described(row)}, not a JSON object"
    epoch = row.get("epoch")
    if not (_is_integer(epoch) and epoch >= 1):
        return f"a row's epoch is {_described(epoch)}, not an integer >= 1"
    for key, value in row.items():
        if not isinstance(key, str):
            return f"epoch {epoch}'s row has a key {_described(key)}, not a string"
        nullable = key in METRICS_NULLABLE and value is None
        if key in METRICS_COUNTS:
            fits, due = _is_integer(value) and value >= (1 if key == "epoch" else 0), "an integer >= 0"
        elif key in METRICS_LISTS:
            odd = next((item for item in value if not _is_number(item)), None) if isinstance(value, list) else None
            if odd is not None or (isinstance(value, list) and None in value):
                return f"epoch {epoch}'s {key} holds {_described(odd)}, not only numbers"
            fits, due = nullable or isinstance(value, list), "a list of numbers"
        elif key in METRICS_NUMBERS:
            fits, due = nullable or _is_number(value), "a number"
        else:
            fits, due = _is_json(value), "a JSON value"
        if not fits:
            return f"epoch {epoch}'s {shown(key, 60)} is {_described(value)}, not {due}"
    return None


def metrics_rows_problem(rows: Any) -> str | None:
    """The first way `rows` (checkpoint.pt's "history") is not a list of metrics rows, or None."""
    if not isinstance(rows, list):
        return f"is {_described(rows)}, not a list of metrics rows"
    problems = (f"row {number}: {why}" for number, row in enumerate(rows, 1) if (why := metrics_row_problem(row)))
    return next(problems, None)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_json(value: Any) -> bool:
    """Whether `value` is JSON data: None, a bool, a number, a string, or lists and string-keyed dicts of them."""
    stack = [value]
    while stack:  # not recursive: a forged value may be nested deeper than Python's recursion limit
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                return False
            stack.extend(item.values())
        elif not (item is None or isinstance(item, bool | int | float | str)):
            return False
    return True


def _described(value: Any) -> str:
    """A value read from a damaged file, for a message line: a scalar as its repr (short), anything else by type."""
    if value is None or isinstance(value, bool | int | float | str):
        return shown(repr(value), 60)
    return f"a {type(value).__name__}"


def write_metrics(run_dir: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """Rewrite metrics.jsonl as a whole (atomically): a resumed run first drops epochs after its checkpoint."""
    write_text_atomic(Path(run_dir) / METRICS, "".join(json.dumps(row) + "\n" for row in rows))


# --- writing a run: the order of the writes, and repairing it after a kill ---------------------------------------


def remove_stale_temporaries(run_dir: str | os.PathLike) -> None:
    """Remove the temporaries of our run files left by killed processes (only ours, by name and dead pid)."""
    for name in (CONFIG, *RESULTS):
        atomic.remove_stale_temporaries(Path(run_dir) / name)


def commit_epoch(run_dir: str | os.PathLike, checkpoint: dict[str, Any]) -> None:
    """Write a finished epoch. checkpoint.pt is the commit point and goes first: best.pt (when this epoch is the best)
    and metrics.jsonl are copies of what it holds, so a kill between the writes leaves only files that `reconcile`
    rebuilds from it. (best.pt first would let a killed epoch's weights replace the best epoch's, which a resume could
    not undo.)"""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG).is_file():  # written before the first epoch: gone only if the run was removed
        raise UsageError(
            f"{run_dir} lost its {CONFIG} while training (the folder was removed or emptied): epoch "
            f"{checkpoint['epoch']} is not written; train again into a new --out"
        )
    save_checkpoint(checkpoint, run_dir / LAST)
    if checkpoint["best_epoch"] == checkpoint["epoch"]:
        save_checkpoint(checkpoint, run_dir / BEST)
    write_metrics(run_dir, checkpoint["history"])


def check_commit_point(run_dir: Path) -> None:
    """A run holding a finished epoch's files (best.pt, metrics.jsonl) holds their commit point, checkpoint.pt:
    commit_epoch writes it first, so only a removal leaves them without it, and a resume would start the run over
    and replace them."""
    left = [name for name in (BEST, METRICS) if (run_dir / name).exists()]
    if left and not (run_dir / LAST).exists():
        raise UsageError(
            f"{run_dir} holds finished epochs ({', '.join(left)}) but not their {LAST}, which was removed; put it back "
            "to resume, or train into a new --out (a resume from nothing would replace them)"
        )


def reconcile(run_dir: str | os.PathLike, checkpoint: dict[str, Any]) -> list[str]:
    """After a kill: make best.pt and metrics.jsonl what `commit_epoch` of `checkpoint` (checkpoint.pt) writes;
    -> what was repaired. Under commit_epoch's order best.pt can only lag when checkpoint.pt is itself the best epoch,
    so best.pt is then a copy of checkpoint.pt."""
    run_dir = Path(run_dir)
    repaired = []
    history, best_epoch = checkpoint["history"], checkpoint["best_epoch"]
    try:
        current = read_metrics(run_dir)
    except UsageError:
        current = None
    if current != history:
        write_metrics(run_dir, history)
        repaired.append(f"{METRICS} (rows of epochs 1-{checkpoint['epoch']})")
    if best_epoch == checkpoint["epoch"] and _epoch_of(run_dir / BEST) != best_epoch:
        with atomic.atomic_path(run_dir / BEST) as tmp:
            shutil.copyfile(run_dir / LAST, tmp)
        repaired.append(f"{BEST} (epoch {best_epoch})")
    return repaired


def differing_fields(a: dict[str, Any], b: dict[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    """The keys (sorted) whose values differ between two config dicts, a key missing on one side included."""
    return [key for key in sorted(set(a) | set(b)) if key not in skip and a.get(key) != b.get(key)]


def differences(config: dict[str, Any], model: dict[str, Any], recipe: dict[str, Any], data: str) -> list[str]:
    """What makes the run `config` (config.json) another run than one of `model`, `recipe` (dicts) and `data` (a
    spec): every field but those a resume may change."""
    found = [f"model {key}" for key in differing_fields(model, config["model"])]
    recorded = config["recipe"]
    found += [
        f"recipe {key}"
        for key in differing_fields(recipe, recorded, MAY_CHANGE_ON_RESUME)
        if not matches_record(key, recipe.get(key), recorded.get(key))
    ]
    if not same_data(data, config["data"].get("spec")):
        found.append(f"data {config['data'].get('spec')}")
    return found


def repair_commit(run_dir: str | os.PathLike) -> list[str]:
    """What a kill between checkpoint.pt and best.pt (or metrics.jsonl) left half-committed, made whole from
    checkpoint.pt (reconcile), as a resume does; -> what was repaired ([] when nothing was, or there is no readable
    checkpoint.pt). For a sweep's finished runs, which it never resumes."""
    path = Path(run_dir) / LAST
    if not path.is_file():
        return []
    try:
        state = load_checkpoint(path, mmap=True)
    except UsageError:
        return []
    if not isinstance(state.get("best_epoch"), int) or metrics_rows_problem(state.get("history")) is not None:
        return []  # a damaged checkpoint.pt: nothing to repair from
    return reconcile(run_dir, state)


def epochs_done(run_dir: str | os.PathLike) -> int:
    """Epochs the run has committed (checkpoint.pt's epoch); 0 before its first, or if checkpoint.pt is unreadable."""
    return _epoch_of(Path(run_dir) / LAST) or 0


def _epoch_of(path: Path) -> int | None:
    if not path.is_file():
        return None
    try:
        return int(load_checkpoint(path, mmap=True)["epoch"])  # the epoch only: leave the tensors on disk
    except (UsageError, KeyError, TypeError, ValueError):
        return None
