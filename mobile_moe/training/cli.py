"""`mobile-moe train`: flags -> (model config, recipe with overrides) -> training.train.train; `--resume` continues.

    mobile-moe train --model mobile-vmoe --size 6x64 --patch 8 --image-size 32 --experts 5 --data digits \
        --super-classes random --recipe tiny --out runs/digits-moe
    mobile-moe train --model mobile-vmoe --init-from runs/digits-vit --experts 5 --data digits --out runs/upcycled
    mobile-moe train --model hard-moe --init-from runs/digits-vit --experts 4 --data digits --out runs/digits-hard
    torchrun --nproc_per_node 4 -m mobile_moe train ...   # DDP: same flags, global --batch-size

`--resume` may be appended to the command that started a run (what a job scheduler does): every flag given must
equal the run's own value, except those in RESUME_HELP.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from mobile_moe.data.augment import INPUT_PIPELINES
from mobile_moe.data.spec_options import DATA_SPECS, SOURCE_SIZE, same_data
from mobile_moe.errors import UsageError
from mobile_moe.models.cli_args import MODEL_FLAGS, add_model_arguments, config_from_args, model_kwargs
from mobile_moe.models.config import parse_size
from mobile_moe.training.recipes import (
    MAY_CHANGE_ON_RESUME,
    RECIPES,
    ROUTE_BY,
    TrainConfig,
    finite_float,
    from_dict,
    matches_record,
    recipe,
)
from mobile_moe.utils.atomic import check_writable
from mobile_moe.utils.devices import DEVICES
from mobile_moe.utils.words import counted, escaped

DEFAULT_RECIPE = "deit"

# flag dest -> TrainConfig field (flags whose value is None were not given)
TRAIN_FLAGS = {
    "epochs": "epochs",
    "batch_size": "batch_size",
    "router_loss": "router_loss_weight",
    "route_by": "route_by",
    "balance_loss": "balance_loss_weight",
    "device": "device",
    "workers": "workers",
    "input_pipeline": "input_pipeline",
    "seed": "seed",
}


def flag_of(field: str) -> str:
    """The flag that sets a TrainConfig field: its own (--epochs, --compile), else --set FIELD."""
    own = {name: f"--{dest.replace('_', '-')}" for dest, name in TRAIN_FLAGS.items()} | {
        "compile": "--compile",
        "cuda_graphs": "--no-cuda-graphs",
    }
    return own.get(field, f"--set {field}")


def listed(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


# The flags a resume may change, in words: MAY_CHANGE_ON_RESUME (recipes.py) is the one list.
RESUME_MAY_CHANGE = [flag_of(field) + (" (to extend)" if field == "epochs" else "") for field in MAY_CHANGE_ON_RESUME]
RESUME_HELP = (
    "continue --out from its checkpoint.pt, or start it if it has none yet; the command that started the run may be "
    "repeated with --resume appended: every flag given must equal the run's own, except "
    f"{listed([*RESUME_MAY_CHANGE, '--quiet'])}"
)


def recipe_defaults(field: str) -> str:
    """A recipe field's default per recipe, for a flag's help: "deit 300, vit 300, tiny 15"."""
    return ", ".join(f"{name} {getattr(make(), field)}" for name, make in RECIPES.items())


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, required=False)
    data = parser.add_argument_group("data")
    data.add_argument("--data", help=DATA_SPECS)
    data.add_argument(
        "--super-classes", help="FILE.json | coarse | truth | random[:SEED] (Mobile V-MoE with a router loss)"
    )
    data.add_argument("--out", required=True, help="run directory (config.json, checkpoint.pt, best.pt, metrics)")
    data.add_argument(
        "--init-from",
        metavar="RUN_DIR",
        help="a trained or imported dense vit run the model starts from: a vit is fine-tuned, an MoE upcycled (every "
        "expert MLP from the dense MLP of its block, routers fresh), a hard-moe's gater; data of other classes gets a "
        "new classifier; model flags default to that run's",
    )
    train = parser.add_argument_group("training")
    train.add_argument("--recipe", choices=sorted(RECIPES), help=f"base recipe (default {DEFAULT_RECIPE})")
    train.add_argument(
        "--epochs", type=int, help=f"epochs to train (default: the recipe's; {recipe_defaults('epochs')})"
    )
    train.add_argument(
        "--batch-size",
        type=int,
        help=f"global batch size, split over DDP processes (default: the recipe's; {recipe_defaults('batch_size')})",
    )
    train.add_argument(
        "--lr", type=finite_float, help="peak learning rate at this --batch-size (default: the recipe's)"
    )
    train.add_argument("--router-loss", type=finite_float, help="lambda, weight of the super-class router loss (0.3)")
    train.add_argument("--route-by", choices=ROUTE_BY, help="route training images by the router or the true label")
    train.add_argument(
        "--balance-loss", type=finite_float, help="weight of the load-balancing loss (end-to-end routing)"
    )
    train.add_argument(
        "--device", choices=DEVICES, help="where to train (default auto: cuda when a GPU is visible, else cpu)"
    )
    train.add_argument("--compile", action="store_true", help="torch.compile the model")
    train.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        default=None,
        help="with --compile on CUDA: the plain compiled step, not replayed as CUDA graphs",
    )
    train.add_argument(
        "--workers",
        type=int,
        help=f"DataLoader workers per process (default: the recipe's; {recipe_defaults('workers')}; -1: one per "
        "usable core)",
    )
    train.add_argument(
        "--input-pipeline",
        choices=INPUT_PIPELINES,
        help="where training images are augmented: workers (per image, torchvision), crop (workers decode and crop "
        "to S x S, the rest one fixed-shape graph on the training device) or device (per batch on the training "
        "device, each image its own draws); default auto: crop when the recipe augments at random, else workers",
    )
    train.add_argument("--seed", type=int, help="seed of the initial weights, data order and augmentation (default 0)")
    train.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe field, type-checked (repeatable)"
    )
    train.add_argument("--resume", action="store_true", help=RESUME_HELP)
    train.add_argument("--quiet", action="store_true", help="no per-epoch lines")


def set_items(args: argparse.Namespace) -> dict[str, str]:
    changes = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--set {item!r}: use KEY=VALUE (e.g. --set mixup_alpha=0.2)")
        changes[key.strip()] = value
    return changes


def overrides(args: argparse.Namespace) -> dict[str, object]:
    changes: dict[str, object] = dict(set_items(args))
    given = {field: getattr(args, flag) for flag, field in TRAIN_FLAGS.items() if getattr(args, flag) is not None}
    changes.update(given)
    if args.compile:
        changes["compile"] = True
    if args.cuda_graphs is False:
        changes["cuda_graphs"] = False
    return changes


def recipe_from_args(args: argparse.Namespace, base: TrainConfig | None = None) -> TrainConfig:
    """--recipe (or `base`, or the default recipe) with the flags and --set applied, --lr excepted."""
    start = recipe(args.recipe) if args.recipe else base or recipe(DEFAULT_RECIPE)
    return start.replace(**overrides(args))


def with_lr(cfg: TrainConfig, lr: float | None) -> TrainConfig:
    return cfg if lr is None else cfg.replace(base_lr=lr, base_batch=cfg.batch_size)


# --- --resume: the given flags against the run's own values ---------------------------------------------------------


def model_differences(args: argparse.Namespace, model: dict[str, Any]) -> list[str]:
    found = []
    if args.model is not None and args.model != model["name"]:
        found.append(f"--model {args.model} differs from the run's {model['name']}")
    # Fields an explicit flag sets (e.g. --patch 8 with --size deit-ti) are compared as that flag, not as the preset.
    preset = {k: v for k, v in parse_size(args.size).items() if getattr(args, k, None) is None} if args.size else {}
    if any(model.get(k) != v for k, v in preset.items()):
        found.append(f"--size {args.size} differs from the run's {model['depth']}x{model['width']}")
    for dest, flag in MODEL_FLAGS.items():
        value = getattr(args, dest)
        if value is not None and value != model.get(dest):
            theirs = model.get(dest, f"{model['name']}, which has no such option")
            found.append(f"{flag} {value} differs from the run's {theirs}")
    if args.model is not None or args.model_kwargs:
        for key, value in model_kwargs(args, args.model or model["name"]).items():
            if value != model.get(key):
                found.append(f"--model-kwargs {key}={value} differs from the run's {model.get(key)}")
    return found


def recipe_differences(args: argparse.Namespace, run_cfg: TrainConfig, given: TrainConfig) -> list[str]:
    sets = set_items(args)
    flag_of = {field: dest for dest, field in TRAIN_FLAGS.items()}
    found, from_recipe = [], []
    for name, theirs in run_cfg.to_dict().items():
        mine = getattr(given, name)
        if name in MAY_CHANGE_ON_RESUME or matches_record(name, mine, theirs):
            continue
        if args.lr is not None and name in ("base_lr", "base_batch"):
            continue  # --lr is compared as the peak learning rate below
        if name in sets:
            found.append(f"--set {name}={sets[name]} differs from the run's {theirs}")
        elif name in flag_of and getattr(args, flag_of[name]) is not None:
            found.append(
                f"--{flag_of[name].replace('_', '-')} {getattr(args, flag_of[name])} differs from the run's {theirs}"
            )
        else:  # without --recipe, `given` starts from the run's own recipe: only --recipe is left to differ
            from_recipe.append(f"{name} {mine} vs the run's {theirs}")
    if from_recipe:
        more = f" and {len(from_recipe) - 3} more" if len(from_recipe) > 3 else ""
        found.append(f"--recipe {args.recipe} differs from the run's recipe ({', '.join(from_recipe[:3])}{more})")
    if args.lr is not None and not math.isclose(args.lr, run_cfg.lr, rel_tol=1e-9):
        found.append(f"--lr {args.lr:g} differs from the run's {run_cfg.lr:g}")
    return found


def init_from_differences(args: argparse.Namespace, config: dict[str, Any]) -> list[str]:
    # torch loads only when the command runs, so `--help` stays fast
    from mobile_moe.training.init_from import same_run_dir

    theirs = config.get("init_from")
    if args.init_from is None or same_run_dir(args.init_from, theirs):
        return []
    return [f"--init-from {args.init_from} differs from the run's {theirs or 'none'}"]


def resume_changes(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, object]:
    """Refuse given flags that differ from the run's (config.json) values; -> the changes a resume may make."""
    # torch loads only when the command runs, so `--help` stays fast
    from mobile_moe.training.imported import refuse_resume

    refuse_resume(config, args.out)
    run_cfg = from_dict(config["recipe"])
    given = recipe_from_args(args, base=run_cfg)
    found = model_differences(args, config["model"])
    if args.data is not None and not same_data(args.data, config["data"]["spec"]):
        found.append(f"--data {args.data} differs from the run's {config['data']['spec']}")
    theirs = (config.get("super_classes") or {}).get("spec")
    mine = None if args.super_classes == "none" else args.super_classes
    if args.super_classes is not None and mine != theirs:
        found.append(f"--super-classes {args.super_classes} differs from the run's {theirs or 'none'}")
    found += init_from_differences(args, config)
    found += recipe_differences(args, run_cfg, given)
    if found:  # each names values from the run's config.json: a forged one's control characters shown escaped
        raise UsageError(
            f"{'; '.join(map(escaped, found))}; --resume continues the run as it was started: give the run's values "
            f"or leave those flags out (only {listed([flag_of(field) for field in MAY_CHANGE_ON_RESUME])} may change), "
            "or start a new --out"
        )
    changed = [name for name in MAY_CHANGE_ON_RESUME if getattr(given, name) != getattr(run_cfg, name)]
    return {name: getattr(given, name) for name in changed}


def resume_command(argv: list[str]) -> str:
    """The command line that continues this run: the same one, with --resume."""
    words = ["mobile-moe", *argv]
    return shlex.join(words if "--resume" in words else [*words, "--resume"])


def run(args: argparse.Namespace) -> None:
    try:
        _run(args)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM (mobile_moe.utils.interrupts): the last checkpoint.pt is whole
        print(f"continue with: {resume_command(sys.argv[1:])}", file=sys.stderr, flush=True)
        raise


def _run(args: argparse.Namespace) -> None:
    # torch: these load only when the command runs, so `mobile-moe train --help` stays fast
    from mobile_moe.training.run_dir import LAST, is_run_dir, read_config
    from mobile_moe.training.train import resume_training, train

    out = Path(args.out)
    check_writable(out, directory=True)
    verbose = not args.quiet
    if args.resume and ((out / LAST).is_file() or (args.model is None and is_run_dir(out))):
        # continue from checkpoint.pt; or, without model flags, restart a failed start from its own config.json
        resume_training(out, verbose=verbose, **resume_changes(args, read_config(out)))
        return
    if args.model is None or args.data is None:
        if args.resume:
            raise UsageError(f"{out} holds no run to resume; start one with --model and --data (--resume may stay)")
        raise UsageError("train needs --model and --data (or --resume to continue an existing --out)")
    # A new run (with --resume too: it has no checkpoint yet, so it starts afresh from the given flags).
    cfg = with_lr(recipe_from_args(args), args.lr)
    model_config = config_from_args(args, **init_defaults(args))
    default_size = args.image_size is None and args.init_from is None
    upsampled = upsampling_note(args.data, model_config.image_size) if default_size else None
    train(
        model_config=model_config,
        train_config=cfg,
        data_spec=args.data,
        super_class_spec=args.super_classes,
        out_dir=out,
        verbose=verbose,
        fit_num_classes=args.num_classes is None,
        init_from=args.init_from,
        notes=[note for note in (default_recipe_note(args, cfg), upsampled) if note is not None],
    )


def default_recipe_note(args: argparse.Namespace, cfg: TrainConfig) -> str | None:
    """Without --recipe a run gets ImageNet's schedule, days on a CPU: said before epoch 1, beside the estimate."""
    if args.recipe is not None:
        return None
    schedule = f"ImageNet's schedule ({counted(cfg.epochs, 'epoch')} of batch {cfg.batch_size})"
    return f"note: no --recipe: the {DEFAULT_RECIPE} recipe, {schedule}; --recipe tiny trains in minutes on a CPU"


def upsampling_note(data_spec: str, image_size: int) -> str | None:
    """A default --image-size (224) on built-in data of 8 px digits trains on upsampled blur at 50x the cost: said
    (the run goes on; it is a choice, only rarely the one meant)."""
    source = SOURCE_SIZE.get(data_spec.partition(":")[0])
    if source is None or image_size <= 4 * source:
        return None
    return (f"note: {data_spec}'s images are {source} px, upsampled to the model's {image_size} px because "
            "--image-size was not given; the demo trains digits at --image-size 32 --patch 8")  # fmt: skip


def init_defaults(args: argparse.Namespace) -> dict[str, object]:
    """With --init-from, the model's fields default to the dense run's, so only E, k and L need giving."""
    if args.init_from is None or args.model is None:
        return {}
    # torch loads only when the command runs, so `--help` stays fast
    from mobile_moe.training.init_from import model_defaults

    return model_defaults(args.model, args.init_from, args.size)
