"""`mobile-moe train`: flags -> (model config, recipe with overrides) -> training.train.train; `--resume` continues.

    mobile-moe train --model mobile-vmoe --size 6x64 --patch 8 --image-size 32 --experts 5 --data digits \
        --super-classes random --recipe tiny --out runs/digits-moe
    torchrun --nproc_per_node 4 -m mobile_moe.cli train ...   # DDP: same flags, global --batch-size
"""

from __future__ import annotations

import argparse

from mobile_moe.cli_args import add_model_arguments, config_from_args
from mobile_moe.errors import UsageError
from training.recipes import DEVICES, RECIPES, ROUTE_BY, recipe

# flag dest -> TrainConfig field (flags whose value is None were not given)
TRAIN_FLAGS = {
    "epochs": "epochs",
    "batch_size": "batch_size",
    "router_loss": "router_loss_weight",
    "route_by": "route_by",
    "balance_loss": "balance_loss_weight",
    "device": "device",
    "workers": "workers",
    "seed": "seed",
}


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, required=False)
    data = parser.add_argument_group("data")
    data.add_argument("--data", help="digits | synthetic[:k=v,...] | cifar10:ROOT | cifar100:ROOT | imagefolder:ROOT")
    data.add_argument(
        "--super-classes", help="FILE.json | coarse | truth | random[:SEED] (Mobile V-MoE with a router loss)"
    )
    data.add_argument("--out", required=True, help="run directory (config.json, checkpoint.pt, best.pt, metrics)")
    train = parser.add_argument_group("training")
    train.add_argument("--recipe", choices=sorted(RECIPES), default="deit", help="base recipe (default deit)")
    train.add_argument("--epochs", type=int)
    train.add_argument("--batch-size", type=int, help="global batch size (split over DDP processes)")
    train.add_argument("--lr", type=float, help="peak learning rate at this --batch-size (default: the recipe's)")
    train.add_argument("--router-loss", type=float, help="lambda, weight of the super-class router loss (0.3)")
    train.add_argument("--route-by", choices=ROUTE_BY, help="route training images by the router or the true label")
    train.add_argument("--balance-loss", type=float, help="weight of the load-balancing loss (end-to-end routing)")
    train.add_argument("--device", choices=DEVICES)
    train.add_argument("--compile", action="store_true", help="torch.compile the model")
    train.add_argument("--workers", type=int, help="DataLoader workers per process")
    train.add_argument("--seed", type=int)
    train.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe field, type-checked (repeatable)"
    )
    train.add_argument("--resume", action="store_true", help="continue --out from its checkpoint.pt")
    train.add_argument("--quiet", action="store_true", help="no per-epoch lines")


def overrides(args: argparse.Namespace) -> dict[str, object]:
    changes: dict[str, object] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--set {item!r}: use KEY=VALUE (e.g. --set mixup_alpha=0.2)")
        changes[key.strip()] = value
    given = {field: getattr(args, flag) for flag, field in TRAIN_FLAGS.items() if getattr(args, flag) is not None}
    changes.update(given)
    if args.compile:
        changes["compile"] = True
    return changes


def run(args: argparse.Namespace) -> None:
    from training.train import resume_training, train

    changes = overrides(args)
    if args.resume:
        given = [flag for flag in ("model", "data", "super_classes", "lr") if getattr(args, flag) is not None]
        if given:
            raise UsageError(f"--resume takes the run's own settings; drop --{', --'.join(given)}".replace("_", "-"))
        resume_training(args.out, verbose=not args.quiet, **changes)
        return
    if args.model is None or args.data is None:
        raise UsageError("train needs --model and --data (or --resume to continue an existing --out)")
    cfg = recipe(args.recipe).replace(**changes)
    if args.lr is not None:
        cfg = cfg.replace(base_lr=args.lr, base_batch=cfg.batch_size)
    model_config = config_from_args(args)
    train(
        model_config,
        cfg,
        args.data,
        args.super_classes,
        args.out,
        verbose=not args.quiet,
        fit_num_classes=args.num_classes is None,
    )
