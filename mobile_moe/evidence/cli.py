"""`mobile-moe reproduce FIGURE`: regenerate one of the paper's figures on any data, as a table, a CSV and a plot.

    mobile-moe reproduce fig3e --data digits-pairs --scale tiny --seeds 3 --out figs    # 2 idle cores, ~35 min
    mobile-moe reproduce fig3a --data cifar100:/data/cifar --scale small --out figs     # a workstation GPU
    mobile-moe reproduce fig1 --data fashion-mnist --scale tiny-gpu --seeds 3 --jobs 8 --out figs  # one GPU
    mobile-moe reproduce fig1 --data imagefolder:/data/imagenet --scale paper --launcher submitit \
        --gpus-per-cell 8 --partition gpu --out figs                                   # a Slurm cluster

Every cell is an ordinary run directory under DIR/runs: the same command run again after a kill resumes the
unfinished runs and never retrains a finished one; figures that share models (fig1 and fig3a; the DeiT-Ti ablations)
share their runs when given the same --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mobile_moe.data.spec_options import DATA_SPECS
from mobile_moe.errors import UsageError
from mobile_moe.evidence.figures import FIGURES, cell_recipes, figure
from mobile_moe.evidence.launch import LAUNCHERS, SlurmOptions
from mobile_moe.evidence.scales import SCALES
from mobile_moe.evidence.scales import scale as scale_named
from mobile_moe.models.registry import check_fits_memory
from mobile_moe.utils.atomic import check_writable
from mobile_moe.utils.devices import DEVICES, resolve_device


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("figure", choices=FIGURES, help="the paper's figure to regenerate")
    parser.add_argument("--data", required=True, help=DATA_SPECS)
    parser.add_argument("--out", required=True, help="directory for FIGURE.md/.csv/.png and the runs behind them")
    parser.add_argument("--scale", choices=sorted(SCALES), default="paper",
                        help="paper: 224 px, 300 epochs (a GPU cluster); small: 32 px, 100 epochs (a workstation "
                        "GPU); tiny: 32 px, small widths, 20 epochs (a laptop CPU, digits); tiny-gpu: tiny's models "
                        "in batches of 1024, 10 epochs (one GPU, Fashion-MNIST; with --jobs)")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=1, help="training seeds per cell (mean and std in the table)")
    parser.add_argument("--epochs", type=int, help="train every cell this many epochs instead of the scale's")
    parser.add_argument("--experts", type=int,
                        help="fig3e: experts E of its routed MoEs (default the paper's 10); data of 10 classes or "
                        "fewer needs fewer, or derived and random super-classes are alike")  # fmt: skip
    parser.add_argument("--device", choices=DEVICES, default="auto", help="where cells train and are evaluated")
    parser.add_argument("--bench", action="store_true",
                        help="also export each cell (ExecuTorch) and measure it on the native runner: p50 latency, "
                        "peak memory, bytes loaded per image")  # fmt: skip
    parser.add_argument("--iterations", type=int, default=50, help="--bench: timed runs per bundle")
    launch = parser.add_argument_group("launching")
    launch.add_argument("--launcher", choices=LAUNCHERS, default="local",
                        help="local: one run after another in this process; submitit: a job per run (Slurm where "
                        "srun exists, else submitit's local executor)")  # fmt: skip
    launch.add_argument("--jobs", type=int, default=1,
                        help="local: train this many runs at a time, side by side on the one device (small models "
                        "leave most of a GPU idle)")  # fmt: skip
    launch.add_argument("--gpus-per-cell", type=int, default=0, help="submitit: GPUs (DDP ranks) per run")
    launch.add_argument("--partition", help="submitit: the Slurm partition")
    launch.add_argument("--timeout-min", type=int, default=3 * 24 * 60, help="submitit: a run's time limit")
    launch.add_argument("--cpus-per-cell", type=int, default=8, help="submitit: CPUs per task (data loading)")


def _check(args: argparse.Namespace) -> None:
    import os

    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        raise UsageError("reproduce launches its own training runs: start it without torchrun (for several GPUs per "
                         "run use --launcher submitit --gpus-per-cell G)")  # fmt: skip
    least = {"seeds": 1, "epochs": 1, "experts": 2, "iterations": 1, "jobs": 1, "gpus_per_cell": 0, "timeout_min": 1,
             "cpus_per_cell": 1}  # fmt: skip
    for name, floor in least.items():
        value = getattr(args, name)
        if value is not None and value < floor:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {value}: must be at least {floor}")
    if args.launcher == "submitit" and args.jobs > 1:
        raise UsageError("--jobs is the local launcher's; submitit's jobs run as the cluster schedules them")
    if args.launcher == "local" and (args.gpus_per_cell or args.partition):
        raise UsageError("--gpus-per-cell and --partition are for --launcher submitit; the local launcher trains each "
                         "run in this process, on one device")  # fmt: skip


def _check_batches(recipes: dict[str, dict], train_images: int, args: argparse.Namespace) -> None:
    """Every cell would refuse a batch larger than the training set: say so once, before the sweep starts."""
    largest = max((cfg["batch_size"] for cfg in recipes.values()), default=0)
    if largest > train_images:
        raise UsageError(f"--scale {args.scale} trains with batches of {largest} images but {args.data} has "
                         f"{train_images} training images; use a smaller --scale (small, tiny)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    # Imported here, not above: they load torch, and `mobile-moe reproduce --help` needs none of it.
    from mobile_moe.data.datasets import open_data
    from mobile_moe.evidence import report
    from mobile_moe.evidence.results import collect
    from mobile_moe.evidence.sweep import stderr_log, sweep

    _check(args)
    out = Path(args.out)
    check_writable(out, directory=True)
    scale = scale_named(args.scale)
    # Before the sweep: --device cuda without CUDA is one line, not a failed row for every cell.
    evaluate_on = str(resolve_device(args.device))
    data = open_data(args.data, scale.image_size)
    groups = data.super_classes.num_super_classes if data.super_classes is not None else None
    fig = figure(args.figure, scale, data.num_classes, groups, args.experts)
    for cell in fig.cells:  # every model before the first trains: --experts 1e20 failed after the dense cells
        if cell.config is not None:
            check_fits_memory(cell.config)
    recipes = cell_recipes(fig, scale, args.epochs, args.device)
    _check_batches(recipes, len(data.split("train")), args)
    options = SlurmOptions(args.gpus_per_cell, args.partition, args.timeout_min, args.cpus_per_cell)
    outcomes = sweep(fig, out, args.data, recipes, args.seeds, args.launcher, options, stderr_log, args.jobs)
    epochs = {name: cfg["epochs"] for name, cfg in recipes.items()}
    results = collect(fig, out, args.seeds, epochs, outcomes, evaluate_on)
    if args.bench:
        from mobile_moe.evidence.bench import bench_cells  # export and device_bench: only with --bench

        bench_cells(out, results, args.data, args.iterations, stderr_log)
    splits = {s["split"] for r in results for s in r.seeds}
    setting = report.Setting(args.data, scale.name, args.seeds, "/".join(map(str, sorted(set(epochs.values())))),
                             "/".join(sorted(splits)) or "test")  # fmt: skip
    paths = report.write_outputs(fig, results, setting, epochs, out, args.bench)
    print(report.markdown(fig, results, setting, args.bench))
    stderr_log(f"wrote {', '.join(map(str, paths))}")
    return 0
