"""`train --init-from RUN_DIR`: a model starts from a dense vit run, ours or imported: an MoE by sparse upcycling, a
vit by fine-tuning.

    mobile-moe train --model mobile-vmoe --init-from runs/vit --experts 5 --data digits --out runs/upcycled
    mobile-moe train --model vit --init-from runs/deit --data imagefolder:data --out runs/deit-ft   # transfer

The model's fields default to the dense run's (only E, k, L need giving); before the first epoch of a fresh run its
best.pt is copied in by the model's own map (mobile_moe/models/upcycle.py: every expert MLP from the dense MLP of its
block, routers fresh). The data is opened with the dense run's preprocessing (mean, std, eval resize), so the model sees
its images as the dense model did (an imported run's are its library's). Data of other classes than the dense run's (an
ImageNet-1k import fine-tuned on your folder) gets a new classifier for its classes, said in one line; everything else
is copied. config.json records the dense run ("init_from") and what was copied ("upcycled", with "new_head"); a resume
reads both and copies nothing (checkpoint.pt holds the weights). A Hard MoE requires --init-from (its gater,
mobile_moe/training/cluster_fit.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mobile_moe.errors import UsageError
from mobile_moe.models.checkpoint import load_checkpoint
from mobile_moe.models.config import ViTConfig, parse_size
from mobile_moe.models.registry import MODELS
from mobile_moe.models.upcycle import check_dense_fits, check_upcyclable, dense_defaults, upcycle
from mobile_moe.training.run_dir import BEST, CONFIG, check_same_model, is_imported, read_config
from mobile_moe.training.run_dir import preprocessing as recorded_preprocessing

HELP = (
    "a dense vit run (ours, or `mobile-moe import`ed) of the same size: the model starts from its weights (data of "
    "other classes gets a new classifier)"
)


def check_init_from(model_config: ViTConfig, init_from: str | os.PathLike | None) -> None:
    """--init-from must fit the model; a Hard MoE requires it. Checked before any data is opened, so a wrong run costs
    nothing."""
    if model_config.routing == "cluster" and init_from is None:
        raise UsageError(f"{model_config.name} trains from a dense gater: give --init-from RUN_DIR, {HELP}")
    if init_from is not None:
        check_dense_fits(model_config, read_config(init_from)["model"], f"--init-from {init_from}")


def announcement(entries: dict[str, Any], data, model_config: ViTConfig) -> str | None:
    """The one line a fresh start from a dense run prints: what was copied from it, and the classifier it got."""
    record = entries.get("upcycled") or entries.get("hard_moe")
    if record is None:
        return None
    if entries.get("hard_moe"):
        copied = "its weights in the frozen trunk and every expert, k-means routing fitted on its features"
    elif model_config.is_moe:
        copied = "upcycled: every expert MLP starts as the dense MLP of its block, routers fresh"
    else:
        copied = "fine-tuning its weights"
    start = f"--init-from {entries['init_from']}: {copied}"
    if not record.get("new_head"):
        return f"{start}; its classifier kept (the same {data.num_classes} classes)"
    return (
        f"{start}; a new classifier for the data's {data.num_classes} classes (the dense run's "
        f"{record['dense_classes']} classes are not the data's); every other weight copied"
    )


def same_run_dir(a: str | os.PathLike | None, b: str | os.PathLike | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def model_defaults(model: str, init_from: str | os.PathLike, size: str | None) -> dict[str, Any]:
    """The dense run's model fields, as defaults for --model `model` (explicit flags win; --size replaces the fields
    its preset sets, so `--size deit-ti` still means patch 16 unless --patch says otherwise)."""
    check_upcyclable(MODELS[model])  # before the run is read: a WideNet is refused whatever the run
    preset = set(parse_size(size)) if size else set()
    return dense_defaults(read_config(init_from)["model"], preset)


def preprocessing(init_from: str | os.PathLike) -> dict[str, Any]:
    """open_data's overrides that feed images as the dense run was fed: its mean, std and eval resize policy."""
    return recorded_preprocessing(read_config(init_from)["data"], Path(init_from) / CONFIG)


def load_dense(model, init_from: str | os.PathLike, *, class_names: list[str]) -> dict[str, Any]:
    """The dense run's best.pt into `model` (upcycled; its classifier left fresh when the dense run classifies other
    classes than `class_names`, the data's); -> the config.json record of what was copied."""
    path = Path(init_from) / BEST
    if not path.is_file():
        raise UsageError(f"--init-from {init_from} has no {BEST} yet; let the dense run finish an epoch")
    state = load_checkpoint(path, map_location="cpu")
    config = read_config(init_from)
    # The fit was checked against config.json; the weights are best.pt's: they must be the same model (an edited
    # norm_eps or head count would load without a shape error and upcycle another function).
    check_same_model(f"--init-from {init_from}", config, state, BEST)
    dense_classes = list(config["data"]["class_names"])
    new_classes = dense_classes != list(class_names)
    fresh = upcycle(model, state["model"], path, new_classes=new_classes)
    return {
        "dense_epoch": int(state["epoch"]) if "epoch" in state else None,
        "dense_source": config["source"].get("model") if is_imported(config) else None,
        "fresh": sorted({key.rsplit(".", 1)[0] for key in fresh}),  # modules that kept their own initialisation
        "new_head": new_classes,
        "dense_classes": len(dense_classes),
    }


def start(model, init_from: str | os.PathLike, data, resumed: dict[str, Any] | None) -> dict[str, Any]:
    """config.json entries of a run started from a dense run: copied now on a fresh start; on a resume, kept from the
    run's own config.json (`resumed`), whose weights checkpoint.pt already holds."""
    if resumed is not None:
        return {"init_from": resumed.get("init_from"), "upcycled": resumed.get("upcycled")}
    check_init_from(model.config, init_from)  # again: the run may have changed while the data was opened
    record = load_dense(model, init_from, class_names=data.class_names)
    return {"init_from": str(Path(init_from).resolve()), "upcycled": record}
