"""An app on libmobile_moe against the native runner, ViT-Ti/32 (E=10, k=1, L=2), 1 thread, in ONE run on this host:

    .venv/bin/python benchmarks/library_vit_ti32.py [--out DIR] [--rounds R] [--iterations N]

Bundles and stream as benchmarks/expert_switch_vit_ti32.py (random weights; a stream of 36 images whose expert changes
on every image). Per round, interleaved: the runner (its timed runs after 10 warm-up runs, one expert cached) and
examples/app_example.c (`mobile_moe_app`, the C API's whole use in an app: open, predict, close; its predictions after
the first 10), first with the runner's settings, then with the library's defaults alone (mm_default_options: no
option set; the default packed-weight folder is MOBILE_MOE_WEIGHT_CACHE, pointed into --out), on the split and the
dense bundle, each a second process on a warm folder (an app's second launch), and the cold start of both from an
empty folder. Printed, each the median over the rounds with its spread ((max - min) / median):

- p50 through the C API / the runner's own loop (goal <= 1.01); peak RSS through the C API / the runner (<= 1.00);
- with the defaults: one-expert / dense peak RSS (<= 1.01); cold start (open + first prediction), split / dense
  (<= 1.10) and split through the C API / the runner's open and first image (<= 1.2); lines on stderr (0);
- cold start, split / dense, from an empty packed-weight folder.

Nothing else may run on the host meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from mobile_moe.device_bench.native_runner import parse_runner_output, runner_command
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.library.build import build_library

sys.path.insert(0, str(Path(__file__).resolve().parent))
from expert_switch_vit_ti32 import export, switching_stream  # noqa: E402

WARMUP = 10


def app(binary: Path, bundle: Path, images: Path, iterations: int, cache: Path | None = None,
        defaults_folder: Path | None = None, flags: tuple[str, ...] = ()) -> dict:
    """One app process: with one expert cached and `cache` as its packed-weight folder, or, where `cache` is None,
    with the library's defaults alone (their packed-weight folder `defaults_folder`: MOBILE_MOE_WEIGHT_CACHE) but
    the app's `flags`."""
    command = [str(binary), str(bundle), str(images), "--iterations", str(iterations), *flags]
    env = dict(os.environ)
    if cache is not None:
        command += ["--threads", "1", "--cache-experts", "1", "--weight-cache-dir", str(cache)]
    else:
        env["MOBILE_MOE_WEIGHT_CACHE"] = str(defaults_folder)
    result = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    report = json.loads(result.stdout)
    report["p50"] = statistics.median(report["ms"][WARMUP:] or report["ms"])
    report["cold_start_ms"] = report["open_ms"] + report["ms"][0]
    report["stderr_lines"] = len(result.stderr.splitlines())
    return report


def runner(binary: Path, bundle: Path, images: Path, cache: Path, iterations: int) -> dict:
    settings = RoundSettings(iterations=iterations, warmup=WARMUP, threads=1, cache_experts=1, switch_repeats=0,
                             weight_cache_dir=str(cache))  # fmt: skip
    result = subprocess.run(runner_command(binary, bundle, images, settings), capture_output=True)
    return parse_runner_output(result.returncode, result.stdout, result.stderr, "native runner", bundle)


def median_and_spread(values: list[float]) -> str:
    middle = statistics.median(values)
    return f"{middle:.3f} (spread {(max(values) - min(values)) / middle:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench-library-vit-ti32"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    library = build_library()
    binary, runner_binary = library.parent / "mobile_moe_app", library.parent.parent / "mobile_moe_runner"
    moe = export(args.out / "moe", "mobile-vmoe", num_experts=10, top_k=1, moe_layers=2)
    dense = export(args.out / "dense", "vit")
    stream = args.out / "stream.f32"
    rate = switching_stream(moe, stream)
    cache = args.out / "packed-weights"
    cache.mkdir(exist_ok=True)
    defaults = args.out / "default-packed-weights"
    for bundle in (moe, dense):  # both folders warm, as on an app's second launch
        app(binary, bundle, stream, 10, cache), app(binary, bundle, stream, 10, defaults_folder=defaults)
    figures = ("p50", "rss", "default rss", "default start", "default start / runner", "stderr", "cold start")
    ratios: dict[str, list[float]] = {name: [] for name in figures}
    for _ in range(args.rounds):
        through_api = app(binary, moe, stream, args.iterations, cache)
        own_loop = runner(runner_binary, moe, stream, cache, args.iterations)
        ratios["p50"].append(through_api["p50"] / own_loop["latency_ms"]["p50"])
        ratios["rss"].append(through_api["peak_rss_bytes"] / own_loop["memory_after_warm"]["peak_rss_bytes"])
        split, whole = (app(binary, b, stream, args.iterations, defaults_folder=defaults) for b in (moe, dense))
        ratios["default rss"].append(split["peak_rss_bytes"] / whole["peak_rss_bytes"])
        ratios["default start"].append(split["cold_start_ms"] / whole["cold_start_ms"])
        runner_start = own_loop["load_ms"]["router"] + own_loop["images"][0]["total_ms"]
        ratios["default start / runner"].append(split["cold_start_ms"] / runner_start)
        ratios["stderr"].append(split["stderr_lines"] + whole["stderr_lines"])
        cold = {}
        for name, bundle in (("moe", moe), ("dense", dense)):
            empty = args.out / f"empty-cache-{name}"
            shutil.rmtree(empty, ignore_errors=True)
            empty.mkdir()
            cold[name] = app(binary, bundle, stream, 1, empty)["cold_start_ms"]
        ratios["cold start"].append(cold["moe"] / cold["dense"])
    print(f"stream change rate {rate:.2f}; {args.rounds} rounds of {args.iterations} predictions")
    print(f"p50 through the C API / the runner's own loop: {median_and_spread(ratios['p50'])} (goal <= 1.01)")
    print(f"peak RSS through the C API / the runner: {median_and_spread(ratios['rss'])} (goal <= 1.00)")
    print(f"defaults: one-expert / dense peak RSS: {median_and_spread(ratios['default rss'])} (goal <= 1.01)")
    print(f"defaults: cold start (open + first prediction), split / dense, second process: "
          f"{median_and_spread(ratios['default start'])} (goal <= 1.10)")  # fmt: skip
    print(f"defaults: cold start of the split bundle, C API / the runner's open and first image: "
          f"{median_and_spread(ratios['default start / runner'])} (goal <= 1.2)")  # fmt: skip
    print(f"defaults: stderr lines of the two apps, open + predict: {max(ratios['stderr']):.0f} at most (goal 0)")
    print(f"cold start, split / dense, from an empty packed-weight folder: {median_and_spread(ratios['cold start'])}")


if __name__ == "__main__":
    main()
