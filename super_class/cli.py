"""`mobile-moe superclass derive|show`: super-classes from a dense run (or a confusion file), and the Table-1 listing.

mobile-moe superclass derive --run runs/dense --num-super-classes 10 --out super_classes.json --plot sc.png
mobile-moe superclass derive --confusion confusion.npy --num-super-classes 10 --out super_classes.json
mobile-moe superclass show super_classes.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mobile_moe.atomic import atomic_path
from mobile_moe.errors import UsageError
from super_class.clustering import METHODS
from super_class.graph import AFFINITIES
from super_class.superclasses import load


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    derive = actions.add_parser("derive", help="cluster a confusion graph into E super-classes", description=__doc__)
    source = derive.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--run", dest="run_dir", metavar="RUN_DIR", help="a trained (dense) run; its best checkpoint is evaluated"
    )
    source.add_argument("--confusion", metavar="FILE", help=".npy or .csv (C, C) matrix, rows = true class")
    derive.add_argument("--data", metavar="SPEC", help="data spec for --run (default: the run's own data)")
    derive.add_argument("--split", default="val", choices=["val", "test", "train"], help="held-out split (--run)")
    derive.add_argument("--num-super-classes", "-E", type=int, required=True, metavar="E")
    derive.add_argument("--method", default="spectral", choices=METHODS)
    derive.add_argument(
        "--affinity", default="auto", choices=("auto", *AFFINITIES), help="confusion graph to cluster (default auto)"
    )
    derive.add_argument("--hard", action="store_true", help="argmax counts instead of summed softmax (--run)")
    derive.add_argument("--seed", type=int, default=0)
    derive.add_argument("--class-names", metavar="FILE", help="one name per line, or a JSON list (default: the run's)")
    derive.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="for --run")
    derive.add_argument("--batch-size", type=int, default=256, help="for --run")
    derive.add_argument("--out", required=True, metavar="FILE.json")
    derive.add_argument("--plot", metavar="FILE.png", help="confusion graph + reordered confusion heat map")
    show = actions.add_parser("show", help="print a super-class file like the paper's Table 1")
    show.add_argument("file", metavar="FILE.json")
    show.add_argument("--examples", type=int, default=3, help="class names shown per super-class")
    show.add_argument("--seed", type=int, default=0, help="seed of the random choice of example names")


def run(args: argparse.Namespace) -> int:
    return derive_command(args) if args.action == "derive" else show_command(args)


def show_command(args: argparse.Namespace) -> int:
    from super_class.table import format_table

    print(format_table(load(args.file), examples=args.examples, seed=args.seed))
    return 0


def read_class_names(path: str) -> list[str]:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read --class-names {path}: {error}") from None
    if path.endswith(".json"):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as error:
            raise UsageError(f"--class-names {path}: not JSON: {error}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise UsageError(f"--class-names {path}: expected a JSON list of strings")
        return names
    return [line.strip() for line in text.splitlines() if line.strip()]


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad flags before any work is done."""
    if args.confusion and (args.hard or args.data):
        raise UsageError("--hard and --data apply to --run only (a --confusion file is already a matrix)")
    if Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a directory; give a file name such as super_classes.json")
    if args.plot:
        from super_class.plot import check_plot_path

        check_plot_path(args.plot)
    if args.num_super_classes < 2:
        raise UsageError(f"--num-super-classes {args.num_super_classes}: need at least 2")


def derive_command(args: argparse.Namespace) -> int:
    from super_class.confusion import load_confusion
    from super_class.derive import Confusion, confusion_from_run, derive_super_classes
    from super_class.table import format_table

    check_arguments(args)
    if args.run_dir:
        confusion = confusion_from_run(args.run_dir, args.data, args.split, args.hard, args.device, args.batch_size)
    else:
        matrix, names = load_confusion(args.confusion)
        confusion = Confusion(
            matrix, names or [f"class {c}" for c in range(len(matrix))], f"confusion:{args.confusion}"
        )
    if args.class_names:
        confusion.class_names = read_class_names(args.class_names)
    super_classes = derive_super_classes(
        confusion.matrix,
        args.num_super_classes,
        method=args.method,
        seed=args.seed,
        class_names=confusion.class_names,
        source=confusion.source,
        affinity=args.affinity,
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
    """Both files or neither: the JSON is renamed into place only after the plot was written."""
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(super_classes.to_dict(), indent=2) + "\n")
        if plot:
            from super_class.plot import plot_super_classes

            plot_super_classes(plot, matrix, super_classes)
