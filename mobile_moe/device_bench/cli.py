"""`mobile-moe bench BUNDLE...`: measure bundles on the host or a phone; write results.json, report.md and plots.

    mobile-moe bench bundles/moe bundles/dense --runtime native --threads 1 --rounds 3 --data digits --out bench/

The command line only: flags become a BenchSettings and device_bench.bench.benchmark does the work (see it for
rounds, runners and what results.json holds).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mobile_moe.device_bench.bench import RUNTIMES, BenchSettings, benchmark
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.device_bench.workload import ORDERS
from mobile_moe.library.options import OPTIONS, from_args
from mobile_moe.utils import jsonio


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "bundles", nargs="+", metavar="BUNDLE", help="bundle directories written by `mobile-moe export`"
    )
    parser.add_argument("--runtime", choices=RUNTIMES, help="default: native for ExecuTorch, onnxruntime for ONNX")
    parser.add_argument(
        "--device",
        default="host",
        help="host; android[:SERIAL] (needs adb and --runner); arm64-emulated (the runner built for ARM64 and run "
        "under qemu-user: real parity, routing and files, emulated latency; `make arm64` sets it up)",
    )
    parser.add_argument("--runner", help="native runner binary for the device (required for android: an arm64 build)")
    # Defaults are the settings' own (RoundSettings, BenchSettings): written once, there.
    each, whole = RoundSettings(), BenchSettings()
    parser.add_argument(
        "--iterations", type=int, default=each.iterations, help=f"timed warm runs per round (default {each.iterations})"
    )
    parser.add_argument(
        "--warmup", type=int, default=each.warmup, help=f"untimed runs before them (default {each.warmup})"
    )
    for option in OPTIONS:  # libmobile_moe's options, as mm_options names, encodes and defaults them
        option.add_flag(parser)
    parser.add_argument(
        "--rounds",
        type=int,
        default=whole.rounds,
        help=f"repeat each measurement this many times (default {whole.rounds})",
    )
    parser.add_argument(
        "--pause", type=float, default=whole.pause_s, help=f"seconds between rounds (default {whole.pause_s:g})"
    )
    parser.add_argument(
        "--data", default=whole.data, help="images: random[:SEED], or a data spec with the bundles' classes (digits)"
    )
    parser.add_argument(
        "--images", type=int, default=whole.images, help=f"images in the routing workload (default {whole.images})"
    )
    parser.add_argument(
        "--order",
        choices=ORDERS,
        default=whole.order,
        help="how a data spec's val images are drawn: "
        + "; ".join(f"{name}: {meaning}" for name, meaning in ORDERS.items())
        + f" (default {whole.order})",
    )
    parser.add_argument("--seed", type=int, default=whole.seed, help=f"the draw's seed (default {whole.seed})")
    parser.add_argument(
        "--switch-repeats",
        type=int,
        default=each.switch_repeats,
        help=f"times each expert switch is timed (default {each.switch_repeats})",
    )
    parser.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    parser.add_argument("--json", action="store_true", help="print results.json on stdout instead of a summary")


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """The flags as BenchSettings, which refuse bad values with the flag's name in one line."""
    round_settings = RoundSettings(
        iterations=args.iterations, warmup=args.warmup, switch_repeats=args.switch_repeats,
        **from_args(args),
    )  # fmt: skip
    return BenchSettings(round_settings, runtime=args.runtime, device=args.device, runner=args.runner,
                         rounds=args.rounds, pause_s=args.pause, data=args.data, images=args.images,
                         order=args.order, seed=args.seed)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    log = (lambda message: print(message, file=sys.stderr)) if args.json else print
    results = benchmark(args.bundles, settings_from_args(args), args.out, log)
    if args.json:
        print(jsonio.dumps(results))
    else:
        print((Path(args.out) / "report.md").read_text())
        print(f"wrote {Path(args.out) / 'results.json'}, report.md and plots")
    return 0
