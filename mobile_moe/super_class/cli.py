"""`mobile-moe superclass derive|show`: super-classes from a dense run (or a confusion file), and the Table-1 listing.

mobile-moe superclass derive --run runs/dense --num-super-classes 10 --out super_classes.json --plot sc.png
mobile-moe superclass derive --confusion confusion.npy --num-super-classes 10 --out super_classes.json
mobile-moe superclass show super_classes.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mobile_moe.errors import UsageError
from mobile_moe.formats.confusion import Confusion, load_confusion
from mobile_moe.formats.superclasses import load, unnamed_classes
from mobile_moe.super_class.graph import AFFINITIES
from mobile_moe.super_class.methods import METHOD_HELP, METHODS
from mobile_moe.super_class.table import format_table
from mobile_moe.utils.atomic import atomic_files, check_not_an_input, check_replaceable, check_writable
from mobile_moe.utils.class_names import class_names_problem, read_class_names
from mobile_moe.utils.devices import DEVICES
from mobile_moe.utils.jsonio import dumps
from mobile_moe.utils.plot_files import read_figure

MAX_SEED = 2**32 - 1  # scikit-learn's random_state range (spectral, balanced)


MAX_RESAMPLES = 1000  # each clusters the whole matrix again


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    derive = actions.add_parser(
        "derive",
        help="cluster a confusion graph into E super-classes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # the examples, a line each
    source = derive.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--run", dest="run_dir", metavar="RUN_DIR", help="a trained (dense) run; its best checkpoint is evaluated"
    )
    source.add_argument("--confusion", metavar="FILE", help=".npy or .csv (C, C) matrix, rows = true class")
    derive.add_argument("--data", metavar="SPEC", help="data spec for --run (default: the run's own data)")
    derive.add_argument("--split", default="val", choices=["val", "test", "train"], help="held-out split (--run)")
    derive.add_argument(
        "--num-super-classes",
        "-E",
        type=int,
        required=True,
        metavar="E",
        help="how many super-classes (the MoE's --experts E); from 2 to the number of classes",
    )
    derive.add_argument(
        "--method",
        default="spectral",
        choices=METHODS,
        help="; ".join(f"{name}: {text}" for name, text in METHOD_HELP.items()),
    )
    derive.add_argument(
        "--affinity", default="auto", choices=("auto", *AFFINITIES), help="confusion graph to cluster (default auto)"
    )
    derive.add_argument("--hard", action="store_true", help="argmax counts instead of summed softmax (--run)")
    derive.add_argument("--seed", type=int, default=0, help="seed of the clustering's k-means steps (default 0)")
    derive.add_argument(
        "--stability",
        type=int,
        default=0,
        metavar="N",
        help="also cluster N bootstrap resamples of the validation images and report how alike the groupings are "
        "(adjusted Rand index; default 0: off)",
    )
    derive.add_argument("--class-names", metavar="FILE", help="one name per line, or a JSON list (default: the run's)")
    derive.add_argument("--device", default="auto", choices=DEVICES, help="for --run")
    derive.add_argument("--batch-size", type=int, default=256, help="for --run")
    derive.add_argument("--out", required=True, metavar="FILE.json")
    derive.add_argument("--plot", metavar="FILE.png", help="confusion graph + reordered confusion heat map")
    show_help = "print a super-class file like the paper's Table 1: each super-class, its size and example classes"
    show = actions.add_parser("show", help=show_help, description=show_help)
    show.add_argument("file", metavar="FILE.json", help="a super-class file (superclass derive --out)")
    show.add_argument("--examples", type=int, default=3, help="class names shown per super-class")
    show.add_argument("--seed", type=int, default=0, help="seed of the random choice of example names")


def run(args: argparse.Namespace) -> int:
    return derive_command(args) if args.action == "derive" else show_command(args)


def show_command(args: argparse.Namespace) -> int:
    if args.examples < 0:
        raise UsageError(f"--examples {args.examples}: give how many class names to show per super-class, 0 or more")
    print(format_table(load(args.file), examples=args.examples, seed=args.seed))
    return 0


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad flags before any work is done."""
    if not 0 <= args.stability <= MAX_RESAMPLES:
        raise UsageError(f"--stability {args.stability}: resamples from 0 (off) to {MAX_RESAMPLES}")
    if args.confusion is not None and (args.hard or args.data is not None):
        raise UsageError("--hard and --data apply to --run only (a --confusion file is already a matrix)")
    if args.num_super_classes < 2:
        raise UsageError(f"--num-super-classes {args.num_super_classes}: need at least 2")
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed {args.seed}: must be between 0 and {MAX_SEED}")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size}: must be at least 1")
    if not args.out:
        raise UsageError("--out is empty; give a file name such as super_classes.json")
    if Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a directory; give a file name such as super_classes.json")
    check_writable(args.out)
    inputs = read_inputs(args)
    check_not_an_input(args.out, inputs, "--out")
    if Path(args.out).suffix.lower() != ".json":
        raise UsageError(f"--out {args.out}: a super-class file is JSON; give a .json name such as super_classes.json")
    check_replaceable(args.out, read=load, kind="super-class file", flag="--out")
    if args.plot is not None:
        from mobile_moe.super_class.plot import check_plot_path  # matplotlib: only with --plot

        if not args.plot:
            raise UsageError("--plot is empty; give a .png, .pdf or .svg file name, or leave --plot out")
        check_plot_path(args.plot)
        if os.path.realpath(args.plot) == os.path.realpath(args.out):  # never raises: a symbolic-link loop is a path
            raise UsageError(f"--plot {args.plot} is the --out file too; give them different names")
        check_writable(args.plot)
        check_not_an_input(args.plot, inputs, "--plot")
        check_replaceable(args.plot, read=read_figure, kind="figure of mobile-moe's", flag="--plot")


def read_inputs(args: argparse.Namespace) -> list[Path]:
    """The files `superclass derive` reads: the run's files or the --confusion file, and --class-names."""
    inputs = [Path(path) for path in (args.confusion, args.class_names) if path]
    run_dir = Path(args.run_dir) if args.run_dir else None
    if run_dir is not None and run_dir.is_dir():
        inputs += run_dir.iterdir()
    return inputs


def derive_command(args: argparse.Namespace) -> int:
    check_arguments(args)
    class_names = read_class_names(args.class_names) if args.class_names is not None else None
    if args.run_dir is not None:
        # Reading a run is training's, the stage below this one.
        from mobile_moe.training.evaluate import confusion_from_run

        confusion = confusion_from_run(args.run_dir, args.data, args.split, args.hard, args.device, args.batch_size)
    else:
        matrix, names = load_confusion(args.confusion)
        problem = class_names_problem(names) if names is not None and class_names is None else None
        if problem:  # before the clustering, not in the super-class file's check after it
            raise UsageError(f"{args.confusion}: header: {problem}; rename it there, or give --class-names FILE")
        confusion = Confusion(matrix, names or unnamed_classes(len(matrix)), f"confusion:{args.confusion}")
    if class_names is not None:
        confusion.class_names = class_names
    # scikit-learn loads here, not above: `mobile-moe superclass --help` needs none of it
    from mobile_moe.super_class.derive import derive_super_classes

    super_classes = derive_super_classes(
        confusion.matrix,
        args.num_super_classes,
        method=args.method,
        seed=args.seed,
        class_names=confusion.class_names,
        source=confusion.source,
        affinity=args.affinity,
        stability_resamples=args.stability,
    )
    missing = super_classes.quality["classes_without_images"]
    if missing:
        names = ", ".join(f"{c} ({super_classes.class_names[c]})" for c in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        print(f"warning: no validation images for class {names}{more}; clustered by its column", file=sys.stderr)
    write_outputs(args.out, args.plot, confusion.matrix, super_classes)
    print(format_table(super_classes, seed=args.seed))
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def write_outputs(out: str, plot: str | None, matrix, super_classes) -> None:
    """The JSON and the plot replace their files together (atomic.atomic_files): an interrupted derive leaves the
    earlier pair, never a new plot beside an old JSON."""
    with atomic_files([out] if plot is None else [out, plot]) as (json_path, *plot_path):
        json_path.write_text(dumps(super_classes.to_dict(), indent=2) + "\n")
        if plot is not None:
            from mobile_moe.super_class.plot import plot_super_classes  # matplotlib: only with --plot

            plot_super_classes(plot_path[0], matrix, super_classes)
