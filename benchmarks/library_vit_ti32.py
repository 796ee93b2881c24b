"""An app on libmobile_moe against the native runner, ViT-Ti/32 (E=10, k=1, L=2), one expert cached, 1 thread, in ONE
run on this host:

    .venv/bin/python benchmarks/library_vit_ti32.py [--out DIR] [--rounds R] [--iterations N]

Bundles and stream as benchmarks/expert_switch_vit_ti32.py (random weights; a stream of 36 images whose expert changes
on every image). Per round, interleaved: the runner (its timed runs after 10 warm-up runs) and native/app_example.c
(`mobile_moe_app`, the C API's whole use in an app: open, predict, close; its predictions after the first 10), both on
one packed-weight cache folder warmed first, then the app on the dense bundle, and an app's cold start (open + first
prediction) of the split and the dense bundle with that folder warm and with an empty one. Printed, each the median
over the rounds with its spread ((max - min) / median):

- p50 through the C API / the runner's own loop (goal <= 1.01); peak RSS through the C API / the runner (<= 1.00);
- cold start, split / dense, packed-weight cache warm (<= 1.10) and cold.

Nothing else may run on the host meanwhile.
"""

from __future__ import annotations

import argparse
import json
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


def app(binary: Path, bundle: Path, images: Path, cache: Path, iterations: int, cache_experts: int) -> dict:
    command = [str(binary), str(bundle), str(images), "--iterations", str(iterations), "--threads", "1",
               "--cache-experts", str(cache_experts), "--weight-cache", str(cache)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    report = json.loads(result.stdout)
    report["p50"] = statistics.median(report["ms"][WARMUP:] or report["ms"])
    report["cold_start_ms"] = report["open_ms"] + report["ms"][0]
    return report


def runner(binary: Path, bundle: Path, images: Path, cache: Path, iterations: int) -> dict:
    settings = RoundSettings(iterations=iterations, warmup=WARMUP, threads=1, cache_experts=1, switch_repeats=0)
    result = subprocess.run(runner_command(binary, bundle, images, settings, cache), capture_output=True)
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
    app(binary, moe, stream, cache, 10, 1), app(binary, dense, stream, cache, 10, 1)  # the cache warm, as on launch 2
    ratios: dict[str, list[float]] = {"p50": [], "rss": [], "warm start": [], "cold start": []}
    for _ in range(args.rounds):
        through_api = app(binary, moe, stream, cache, args.iterations, 1)
        own_loop = runner(runner_binary, moe, stream, cache, args.iterations)
        dense_app = app(binary, dense, stream, cache, args.iterations, 1)
        ratios["p50"].append(through_api["p50"] / own_loop["latency_ms"]["p50"])
        ratios["rss"].append(through_api["peak_rss_bytes"] / own_loop["memory_after_warm"]["peak_rss_bytes"])
        ratios["warm start"].append(through_api["cold_start_ms"] / dense_app["cold_start_ms"])
        cold = {}
        for name, bundle in (("moe", moe), ("dense", dense)):
            empty = args.out / f"empty-cache-{name}"
            shutil.rmtree(empty, ignore_errors=True)
            empty.mkdir()
            cold[name] = app(binary, bundle, stream, empty, 1, 1)["cold_start_ms"]
        ratios["cold start"].append(cold["moe"] / cold["dense"])
    print(f"stream change rate {rate:.2f}; {args.rounds} rounds of {args.iterations} predictions")
    print(f"p50 through the C API / the runner's own loop: {median_and_spread(ratios['p50'])} (goal <= 1.01)")
    print(f"peak RSS through the C API / the runner: {median_and_spread(ratios['rss'])} (goal <= 1.00)")
    print(f"cold start (open + first prediction), split / dense, packed weights warm: "
          f"{median_and_spread(ratios['warm start'])} (goal <= 1.10)")  # fmt: skip
    print(f"the same from an empty packed-weight cache: {median_and_spread(ratios['cold start'])}")


if __name__ == "__main__":
    main()
