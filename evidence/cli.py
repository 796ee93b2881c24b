"""`mobile-moe reproduce FIGURE`: regenerate one of the paper's figures on any data, as a table, a CSV and a plot.

    mobile-moe reproduce fig3e --data digits --scale tiny --seeds 3 --out figs          # this laptop, ~15 min
    mobile-moe reproduce fig3a --data cifar100:/data/cifar --scale small --out figs     # a workstation GPU
    mobile-moe reproduce fig1 --data imagefolder:/data/imagenet --scale paper --launcher submitit \
        --gpus-per-cell 8 --partition gpu --out figs                                   # a Slurm cluster

Every cell is an ordinary run directory under DIR/runs: the same command run again after a kill resumes the
unfinished runs and never retrains a finished one; figures that share models (fig1 and fig3a; the DeiT-Ti ablations)
share their runs when given the same --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from evidence.figures import FIGURES
from evidence.scales import SCALES
from evidence.sweep import LAUNCHERS
from mobile_moe.errors import UsageError
from training.recipes import DEVICES


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("figure", choices=FIGURES, help="the paper's figure to regenerate")
    parser.add_argument("--data", required=True, help="digits | synthetic[:k=v,...] | cifar10:ROOT | cifar100:ROOT | "
                        "imagefolder:ROOT")  # fmt: skip
    parser.add_argument("--out", required=True, help="directory for FIGURE.md/.csv/.png and the runs behind them")
    parser.add_argument("--scale", choices=sorted(SCALES), default="paper",
                        help="paper: 224 px, 300 epochs (a GPU cluster); small: 32 px, 100 epochs (a workstation "
                        "GPU); tiny: 32 px, small widths, 20 epochs (a laptop CPU, digits)")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=1, help="training seeds per cell (mean and std in the table)")
    parser.add_argument("--epochs", type=int, help="train every cell this many epochs instead of the scale's")
    parser.add_argument("--device", choices=DEVICES, default="auto", help="where cells train and are evaluated")
    parser.add_argument("--bench", action="store_true",
                        help="also export each cell (ExecuTorch) and measure it on the native runner: p50 latency, "
                        "peak memory, bytes loaded per image")  # fmt: skip
    parser.add_argument("--iterations", type=int, default=50, help="--bench: timed runs per bundle")
    launch = parser.add_argument_group("launching")
    launch.add_argument("--launcher", choices=LAUNCHERS, default="local",
                        help="local: one run after another in this process; submitit: a job per run (Slurm where "
                        "srun exists, else submitit's local executor)")  # fmt: skip
    launch.add_argument("--gpus-per-cell", type=int, default=0, help="submitit: GPUs (DDP ranks) per run")
    launch.add_argument("--partition", help="submitit: the Slurm partition")
    launch.add_argument("--timeout-min", type=int, default=3 * 24 * 60, help="submitit: a run's time limit")


def _check(args: argparse.Namespace) -> None:
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("reproduce launches its own training runs: start it without torchrun (for several GPUs per "
                         "run use --launcher submitit --gpus-per-cell G)")  # fmt: skip
    for flag, value, least in (("--seeds", args.seeds, 1), ("--epochs", args.epochs, 1),
                               ("--iterations", args.iterations, 1), ("--gpus-per-cell", args.gpus_per_cell, 0),
                               ("--timeout-min", args.timeout_min, 1)):  # fmt: skip
        if value is not None and value < least:
            raise UsageError(f"{flag} {value}: must be at least {least}")
    if args.launcher == "local" and (args.gpus_per_cell or args.partition):
        raise UsageError("--gpus-per-cell and --partition are for --launcher submitit; the local launcher trains in "
                         "this process (use torchrun for several GPUs)")  # fmt: skip


def cell_recipes(fig, scale, epochs: int | None, device: str) -> dict[str, dict]:
    """Each runnable cell's TrainConfig (as a dict, without the seed): its recipe at the scale's epochs and batch."""
    from training.recipes import recipe

    recipes = {}
    for cell in fig.cells:
        if cell.skip is None:
            changes = {"epochs": epochs or scale.epochs, "device": device, **cell.recipe_changes}
            if scale.batch_size is not None:
                changes["batch_size"] = scale.batch_size
            recipes[cell.name] = recipe(cell.recipe).replace(**changes).to_dict()
    return recipes


def run(args: argparse.Namespace) -> int:
    from evidence import report
    from evidence.figures import figure
    from evidence.results import collect
    from evidence.scales import scale as scale_named
    from evidence.sweep import SlurmOptions, stderr_log, sweep
    from mobile_moe.atomic import check_writable
    from training.data import open_data
    from training.distributed import resolve_device

    _check(args)
    out = Path(args.out)
    check_writable(out, directory=True)
    scale = scale_named(args.scale)
    num_classes = open_data(args.data, scale.image_size).num_classes
    fig = figure(args.figure, scale, num_classes)
    recipes = cell_recipes(fig, scale, args.epochs, args.device)
    options = SlurmOptions(args.gpus_per_cell, args.partition, args.timeout_min)
    outcomes = sweep(fig, out, args.data, recipes, args.seeds, args.launcher, options, stderr_log)
    evaluate_on = str(resolve_device(args.device))
    epochs = {name: cfg["epochs"] for name, cfg in recipes.items()}
    results = collect(fig, out, args.seeds, epochs, outcomes, evaluate_on)
    if args.bench:
        from evidence.bench import bench_cells

        bench_cells(out, results, args.data, args.iterations, stderr_log)
    splits = {s["split"] for r in results for s in r.seeds}
    setting = report.Setting(args.data, scale.name, args.seeds, "/".join(map(str, sorted(set(epochs.values())))),
                             "/".join(sorted(splits)) or "test")  # fmt: skip
    paths = report.write_outputs(fig, results, setting, epochs, out, args.bench)
    print(report.markdown(fig, results, setting, args.bench))
    stderr_log(f"wrote {', '.join(map(str, paths))}")
    return 0
