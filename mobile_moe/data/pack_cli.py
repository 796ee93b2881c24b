"""`mobile-moe pack SPEC --out STORE`: a pre-resized image store of a data spec (mobile_moe/data/store.py)."""

from __future__ import annotations

import argparse
import sys

from mobile_moe.data.spec_options import DATA_SPECS

EXAMPLE = "mobile-moe pack imagefolder:/data/imagenet --out /data/in-256   # then: --data packed:/data/in-256"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = f"example:\n  {EXAMPLE}"
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("spec", metavar="SPEC", help=DATA_SPECS)
    parser.add_argument("--out", required=True, metavar="STORE", help="the store directory (replaced only if a store)")
    parser.add_argument("--max-side", type=int, default=256, help="longest image side in the store (default 256)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality 1-100 (default 90)")


def run(args: argparse.Namespace) -> None:
    from mobile_moe.data import store
    from mobile_moe.data.datasets import open_data
    from mobile_moe.errors import UsageError
    from mobile_moe.utils.atomic import check_writable

    if args.max_side < 1:
        raise UsageError(f"--max-side {args.max_side}: must be at least 1")
    if not 1 <= args.quality <= 100:
        raise UsageError(f"--quality {args.quality}: must be between 1 and 100")
    check_writable(args.out, directory=True)  # before the source is opened: a folder's check may take minutes
    data = open_data(args.spec, args.max_side)
    out = store.pack(data, args.out, max_side=args.max_side, quality=args.quality, progress=sys.stderr.isatty())
    print(f"packed {args.spec} into {out}; train or evaluate with --data packed:{out}")
