"""`mobile-moe import`: a timm or torchvision ViT checkpoint -> a dense run directory (docs/formats.md).

    RUN_DIR/config.json  {"version": 1, "model": our ViTConfig, "data": {"spec": null, "image_size", "mean", "std",
                          "class_names", "eval_resize"}, "super_classes": null, "recipe": null,
                          "source": {"model", "weights", "sha256", "bytes", "max_abs_logit_difference"}}
    RUN_DIR/best.pt      {"version": 1, "model": state_dict, "config": the model config, "source": the same record}

The data record is the source library's preprocessing (mean, std, resize and crop, interpolation), so evaluating the
run, deriving its super-classes and training from it (--init-from) feed it images as its own library would. It has
no data spec (the run was not trained here): commands that read its images take --data. It has no training state
either, so it cannot be resumed; it is a starting point (`train --init-from RUN_DIR`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from mobile_moe.errors import UsageError
from mobile_moe.importers import import_vit, parse_source, read_state_dict
from mobile_moe.models.checkpoint import save_checkpoint
from mobile_moe.training.run_dir import BEST, is_imported, write_config
from mobile_moe.utils.atomic import atomic_path, check_writable
from mobile_moe.utils.class_names import class_names_problem, read_class_names


def import_run(model: str, weights: str | os.PathLike, out: str | os.PathLike, class_names: str | None = None) -> dict:
    """Import `weights` of `model` ("timm:NAME" | "torchvision:NAME") into a new run directory `out`, written whole
    or not at all; -> the run's source record."""
    source = parse_source(model)
    out = Path(out)
    if out.is_symlink():
        raise UsageError(f"--out {out} is a symbolic link; give a new directory's own path")
    check_writable(out, directory=True)
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} is not empty; import into a new directory")
    imported = import_vit(source, read_state_dict(weights, source))
    names = class_names_from(class_names, imported.config.num_classes) if class_names else imported.class_names
    if names is None:
        raise UsageError(
            f"{source} has {imported.config.num_classes} classes, not ImageNet-1k's 1000: give their names with "
            "--class-names (a text file with one name per line, or an image folder whose class folders name them)"
        )
    record = source_record(str(source), Path(weights), imported.max_abs_difference)
    config = {
        "model": imported.config.to_dict(),
        "data": {
            "spec": None,
            "image_size": imported.config.image_size,
            "mean": imported.preprocessing.mean,
            "std": imported.preprocessing.std,
            "class_names": names,
            "eval_resize": imported.preprocessing.eval_resize,
        },
        "super_classes": None,
        "recipe": None,
        "source": record,
    }
    with atomic_path(out, directory=True) as tmp:
        write_config(tmp, config)
        checkpoint = {"model": imported.state_dict, "config": config["model"], "source": record}
        save_checkpoint(checkpoint, tmp / BEST)
        _release_empty(out)
    return record


def _release_empty(out: Path) -> None:
    """Remove `out` if it is (still) an empty directory, so the finished run is renamed into its place; refuse if a
    file appeared in it during the import: atomic_path would replace the directory whole, and that file is not ours."""
    if not out.exists():
        return
    try:
        out.rmdir()
    except OSError:
        raise UsageError(f"--out {out} is no longer empty (something was written into it during the import); nothing "
                         "was imported: import into a new directory") from None  # fmt: skip


def source_record(model: str, weights: Path, difference: float) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(weights, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {
        "model": model,
        "weights": str(weights.resolve()),
        "sha256": digest.hexdigest(),
        "bytes": weights.stat().st_size,
        "max_abs_logit_difference": difference,
    }


def class_names_from(source: str, num_classes: int) -> list[str]:
    """Class names from a directory (its sub-folder names, sorted: ImageFolder's order, e.g. ImageNet's val folder)
    or a names file (mobile_moe.utils.class_names); there must be one distinct name per class."""
    path = Path(source).expanduser()
    if path.is_dir():
        names = sorted(entry.name for entry in path.iterdir() if entry.is_dir())
        problem = class_names_problem(names)  # a names file is checked as it is read (read_class_names)
        if problem is not None:
            raise UsageError(f"--class-names {path}: {problem}")
    else:
        names = read_class_names(path)
    if len(names) != num_classes:
        raise UsageError(
            f"--class-names {path}: {len(names)} names for a model with "
            f"{num_classes} classes; give one distinct name per class, in the order of the model's outputs (for a "
            "folder of other classes, import without --class-names, then `train --model vit --init-from RUN_DIR` "
            "fine-tunes a new classifier for them)"
        )
    return names


def refuse_resume(config: dict[str, Any], run_dir: str | os.PathLike) -> None:
    """An imported run holds no training state: it is a starting point, never resumed (that would retrain it)."""
    if is_imported(config):
        raise _not_resumable(config["source"].get("model"), run_dir)


def refuse_training_into(run_dir: str | os.PathLike) -> None:
    """Training into an imported run's directory is refused as what it is (its config.json read leniently: a damaged
    one is left to the caller's own error)."""
    try:
        config = json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    if isinstance(config, dict) and isinstance(config.get("source"), dict):
        raise _not_resumable(config["source"].get("model"), run_dir)


def _not_resumable(source: Any, run_dir: str | os.PathLike) -> UsageError:
    return UsageError(
        f"{run_dir} was imported from {source}, not trained here, so it cannot be resumed or trained into; train from "
        f"it into a new --out with --init-from {run_dir}"
    )
