"""Expert switches at the physical limit, for the paper's ViT-Ti/32 (12x192, patch 32, 224 px, 1000 classes; Mobile
V-MoE E=10, k=1, L=2), native runner, 1 inference thread (and 2), in ONE run on this host:

    .venv/bin/python benchmarks/expert_switch_vit_ti32.py [--out DIR] [--router-block J] [--rounds R]

Bundles: the dense ViT, the default Mobile V-MoE, the same model with early routing (router_block=J: the router reads
the tokens after dense block J, and the runner loads the chosen expert while the trunk's last blocks run, or in line
with --prefetch 0), and the default model in the per-block layout (attention exported apart from the experts). Each MoE
bundle gets a stream of images whose chosen expert changes from one image to the next (change rate >= 0.7, printed),
made by routing random images and ordering them; the default model and the dense one also run a stream at issue 37's
change rate (0.44: runs of 2, 2, 2 and 3 images routed alike), where the p50 is mostly images that hit. Every bundle
runs with a packed-weight cache directory (--weight-cache-dir) filled by an untimed first run, as an app's second launch
finds it; the runs are interleaved, --rounds times, and each ratio is the median over the rounds with its spread
((max - min) / median).

Printed, with issue 37's goals ("switch added": a switch's load + first run minus the same expert's warm run):
warm-cache switch added over a hit / warm p50 (<= 0.03: back to a parked expert, the default), also with evicted
experts unloading (--park-experts 0) and with every expert in one XNNPACK workspace (--workspace-sharing global), with
the cold switch and the switch without a cache beside it; one-expert-cache p50 (the default and unloading)
MoE/dense (<= 1.02), with and without prefetch, per-block, at 1 and 2 threads, at issue 37's change rate; peak RSS
one-expert / dense (<= 1.00) and with prefetch (max experts resident, reported); all-experts p50 MoE/dense (<= 1.01);
and, from the routing pass, how long a switching image waited for its load with and without prefetch. Weights and images
are random: latency, memory and size do not depend on their values. Nothing else may run on the host meanwhile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
from pathlib import Path

import numpy as np
import torch

from mobile_moe.device_bench.native_runner import parse_runner_output, runner_command
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.export.bundle import export_bundle
from mobile_moe.export.manifest import MANIFEST
from mobile_moe.export.runtime import load_bundle
from mobile_moe.library.build import build_runner
from mobile_moe.models.registry import create_model

# Issue 37's digits stream changed expert on 45% of consecutive images: runs of 2, 2, 2 and 3 images change on 4 of 9.
ISSUE_37_RUN_LENGTHS = (2, 2, 2, 3)


def export(out: Path, model: str, layout: str | None = None, num_classes: int = 1000, **kwargs) -> Path:
    if not (out / MANIFEST).exists():
        torch.manual_seed(0)  # every MoE bundle the same weights: the per-block one routes as the default one
        network = create_model(model, "12x192", num_classes=num_classes, **kwargs).eval()
        export_bundle(network, out, "executorch", layout=layout)
    return out


def switching_stream(bundle: Path, out: Path, run_lengths: tuple[int, ...] = (1,), count: int = 36,
                     pool: int = 160) -> float:  # fmt: skip
    """Write `count` random images to `out` in runs of images that choose one expert, the run lengths cycling
    through `run_lengths` ((1,): the expert changes from every image to the next where the pool allows), each run's
    expert another than the last run's, spread over as many experts as the pool reaches; -> the stream's expert change
    rate (cyclically, as the runner repeats the stream)."""
    images = np.random.default_rng(0).standard_normal((pool, 3, 224, 224), dtype=np.float32)
    runtime = load_bundle(bundle, cache_experts=1)
    experts = [runtime.predict(image).experts[0] for image in images]
    groups: dict[int, list[int]] = {}
    for index, expert in enumerate(experts):
        groups.setdefault(expert, []).append(index)
    used = dict.fromkeys(groups, 0)
    order, last = [], None
    for length in itertools.cycle(run_lengths):
        options = [e for e in groups if len(groups[e]) >= length and e != last]
        if len(order) >= count or not options:
            break
        expert = min(options, key=lambda e: (used[e], -len(groups[e])))
        order += [groups[expert].pop() for _ in range(min(length, count - len(order)))]
        used[expert] += 1
        last = expert
    images[order].tofile(out)
    chosen = [experts[i] for i in order]
    return float(np.mean([a != b for a, b in zip(chosen, chosen[1:] + chosen[:1], strict=True)]))


def run(runner: Path, bundle: Path, images: Path, cache_dir: Path | None, cache_experts: int | None, threads: int,
        args, extra: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """One runner process; `cache_dir` None: no packed-weight cache (every load packs); `cache_experts` None: every
    expert; `extra`: more runner flags."""
    settings = RoundSettings(iterations=args.iterations, warmup=10, threads=threads,
                             cache_experts=0 if cache_experts is None else cache_experts,
                             weight_cache_dir="" if cache_dir is None else str(cache_dir))  # fmt: skip
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    command = [*runner_command(runner, bundle, images, settings), *extra]
    result = subprocess.run(command, capture_output=True)
    return parse_runner_output(result.returncode, result.stdout, result.stderr, "native runner", bundle)


def median_and_spread(values: list[float]) -> tuple[float, float]:
    middle = statistics.median(values)
    return middle, (max(values) - min(values)) / middle if middle else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-expert-switch-vit-ti32")
    parser.add_argument("--router-block", type=int, default=6)
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    root = Path(args.out)
    runner = build_runner()
    bundles = {
        "dense": export(root / "dense", "vit"),
        "moe": export(root / "moe", "mobile-vmoe"),
        "early": export(root / f"moe-j{args.router_block}", "mobile-vmoe", router_block=args.router_block),
        "per-block": export(root / "moe-per-block", "mobile-vmoe", layout="per-block"),
    }
    bundles["moe-45"], bundles["dense-45"] = bundles["moe"], bundles["dense"]  # on a stream at issue 37's change rate
    streams = {name: root / f"{name}.f32" for name in ("moe", "early", "moe-45")}
    run_lengths = {"moe": (1,), "early": (1,), "moe-45": ISSUE_37_RUN_LENGTHS}
    rates = {name: switching_stream(bundles[name], streams[name], run_lengths[name]) for name in streams}
    streams["dense"] = streams["per-block"] = streams["moe"]
    streams["dense-45"] = streams["moe-45"]
    global_workspace = ("--workspace-sharing", "global")  # every expert's method runs in one XNNPACK workspace
    in_line = ("--prefetch", "0")  # a missed expert loads on the image's thread, where prefetch would use a second one
    unload = ("--park-experts", "0")  # an evicted expert unloads (the default parks it: graphs.h ExpertCache)
    configs = {  # name: (bundle, experts cached, packed-weight cache, inference threads, more runner flags)
        "dense": ("dense", None, True, 1, ()),
        "moe-one": ("moe", 1, True, 1, ()),
        "moe-one-unload": ("moe", 1, True, 1, unload),
        "moe-one-global": ("moe", 1, True, 1, global_workspace),
        "moe-one-packing": ("moe", 1, False, 1, ()),
        "moe-all": ("moe", None, True, 1, ()),
        "early-one": ("early", 1, True, 1, ()),
        "early-one-in-line": ("early", 1, True, 1, in_line),
        "per-block-one": ("per-block", 1, True, 1, ()),
        "per-block-all": ("per-block", None, True, 1, ()),
        "dense-45": ("dense-45", None, True, 1, ()),
        "moe-one-45": ("moe-45", 1, True, 1, ()),
        "moe-one-45-unload": ("moe-45", 1, True, 1, unload),
        "dense-t2": ("dense", None, True, 2, ()),
        "moe-one-t2": ("moe", 1, True, 2, ()),
        "early-one-t2": ("early", 1, True, 2, ()),
        "early-one-in-line-t2": ("early", 1, True, 2, in_line),
        "per-block-one-t2": ("per-block", 1, True, 2, ()),
    }
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for round_index in range(args.rounds + 1):  # round 0 fills the packed-weight caches and is not counted
        for name, (bundle, cache, packed_cache, threads, extra) in configs.items():
            cache_dir = root / "cache" / bundles[bundle].name if packed_cache else None
            report = run(runner, bundles[bundle], streams[bundle], cache_dir, cache, threads, args, extra)
            if round_index:
                runs[name].append(report)
    print_table(runs, rates, args.router_block)
    (root / "runs.json").write_text(json.dumps({name: reports for name, reports in runs.items()}))


def print_table(runs: dict[str, list[dict]], rates: dict[str, float], router_block: int) -> None:
    def ratio(name: str, value, baseline: str = "dense") -> tuple[float, float]:
        return median_and_spread(
            [value(moe) / value(dense) for moe, dense in zip(runs[name], runs[baseline], strict=True)]
        )

    p50 = lambda report: report["latency_ms"]["p50"]  # noqa: E731
    peak = lambda report: report["memory_after_warm"]["peak_rss_bytes"]  # noqa: E731
    def added(name: str) -> list[float]:  # a switch's load + first run over the same expert's warm run / warm p50
        return [(r["switch"]["median_ms"] - r["switch"]["warm_expert_run_median_ms"]) / p50(r) for r in runs[name]]

    warm_added = added("moe-one")
    cold_added = [(r["switch"]["cold"]["median_ms"] - r["switch"]["warm_expert_run_median_ms"]) / p50(r)
                  for r in runs["moe-one"]]  # fmt: skip
    packing_added = added("moe-one-packing")
    early = f"router_block={router_block}"
    rows = [
        (
            "stream expert change rate, default / early routing / issue 37's",
            (rates["moe"], 0.0),
            "(>= 0.7)",
            f"{rates['early']:.2f} / {rates['moe-45']:.2f}",
        ),
        ("switch added over a hit / warm p50, warm packed cache", median_and_spread(warm_added), "<= 0.03",
         "back to a parked expert"),  # fmt: skip
        ("switch added over a hit / warm p50, warm packed cache, evicted experts unload",
         median_and_spread(added("moe-one-unload")), "(report)", "--park-experts 0"),  # fmt: skip
        (
            "switch added over a hit / warm p50, warm packed cache, one global workspace",
            median_and_spread(added("moe-one-global")),
            "<= 0.03",
            "--workspace-sharing global",
        ),  # fmt: skip
        ("switch added over a hit / warm p50, empty cache (cold)", median_and_spread(cold_added), "(report)", ""),
        (
            "switch added over a hit / warm p50, no packed-weight cache",
            median_and_spread(packing_added),
            "(report)",
            "packs on every load",
        ),  # fmt: skip
        ("p50 MoE/dense, one expert cached", ratio("moe-one", p50), "<= 1.02", ""),
        ("p50 MoE/dense, one expert cached, evicted experts unload", ratio("moe-one-unload", p50), "(report)",
         "--park-experts 0"),  # fmt: skip
        (
            "p50 MoE/dense, one expert cached, a stream at issue 37's change rate",
            ratio("moe-one-45", p50, "dense-45"),
            "<= 1.02",
            f"change rate {rates['moe-45']:.2f}",
        ),  # fmt: skip
        ("p50 MoE/dense, one expert cached, issue 37's change rate, evicted experts unload",
         ratio("moe-one-45-unload", p50, "dense-45"), "(report)", "--park-experts 0"),  # fmt: skip
        ("p50 MoE/dense, one expert cached, one global workspace", ratio("moe-one-global", p50), "<= 1.02", ""),
        ("p50 MoE/dense, one expert cached, no packed-weight cache", ratio("moe-one-packing", p50), "(report)", ""),
        (f"p50 MoE/dense, one expert cached, {early}, prefetch", ratio("early-one", p50), "<= 1.02", ""),
        (f"p50 MoE/dense, one expert cached, {early}, in line", ratio("early-one-in-line", p50), "(report)",
         "--prefetch 0"),  # fmt: skip
        ("p50 MoE/dense, one expert cached, per-block layout", ratio("per-block-one", p50), "<= 1.02", ""),
        ("p50 MoE/dense, all experts cached", ratio("moe-all", p50), "<= 1.01", ""),
        ("p50 MoE/dense, all experts cached, per-block", ratio("per-block-all", p50), "<= 1.01", ""),
    ]
    for name, what in [("moe-one", "one expert cached"), ("early-one", f"{early}, prefetch"),
                       ("early-one-in-line", f"{early}, in line"), ("per-block-one", "per-block layout")]:  # fmt: skip
        rows.append((f"p50 MoE/dense, 2 threads, {what}", ratio(f"{name}-t2", p50, "dense-t2"), "(report)", ""))
    rows += [
        ("peak RSS one expert / dense", ratio("moe-one", peak), "<= 1.00", ""),
        ("peak RSS one expert / dense, at issue 37's change rate", ratio("moe-one-45", peak, "dense-45"), "<= 1.00",
         ""),  # fmt: skip
        ("peak RSS one expert / dense, evicted experts unload", ratio("moe-one-unload", peak), "(report)",
         "--park-experts 0"),  # fmt: skip
        ("peak RSS one expert, per-block / dense", ratio("per-block-one", peak), "<= 1.00", ""),
        ("peak RSS one expert, one global workspace / dense", ratio("moe-one-global", peak), "<= 1.00", ""),
        (
            "peak RSS one expert with prefetch / dense",
            ratio("early-one", peak),
            "(report)",
            f"max experts resident {max(r['max_experts_resident'] for r in runs['early-one'])}",
        ),  # fmt: skip
    ]
    print("\n| measure | median | spread | goal | note |\n|---|---:|---:|---|---|")
    for what, (value, spread), goal, note in rows:
        print(f"| {what} | {value:.3f} | {spread:.3f} | {goal} | {note} |")
    parts = runs["moe-one"][0]["switch"]["parts_median_ms"]
    cold = runs["moe-one"][0]["switch"]["cold"]["parts_median_ms"]
    shared = runs["moe-one-global"][0]["switch"]["parts_median_ms"]
    print("\nswitch parts, ms (first round; warm | cold | warm, one global workspace): " + ", ".join(
        f"{key} {parts[key]:.3f} | {cold[key]:.3f} | {shared[key]:.3f}" for key in parts))  # fmt: skip
    unloading = runs["moe-one-unload"][0]["switch"]["parts_median_ms"]
    print("switch parts, ms (first round; evicted experts unload): " + ", ".join(
        f"{key} {unloading[key]:.3f}" for key in unloading))  # fmt: skip
    for name in ("moe-one", "moe-one-unload", "moe-one-global"):
        first = statistics.median(r["switch"]["first_run_median_ms"] for r in runs[name])
        warm = statistics.median(r["switch"]["warm_expert_run_median_ms"] for r in runs[name])
        print(f"{name}: an expert's first run {first:.3f} ms, its warm run {warm:.3f} ms")
    print(f"dense p50 {statistics.median(p50(r) for r in runs['dense']):.2f} ms (1 thread), "
          f"{statistics.median(p50(r) for r in runs['dense-t2']):.2f} ms (2 threads)")  # fmt: skip
    for name in ("moe-one", "early-one", "early-one-in-line", "per-block-one"):
        waits = [row["load_wait_ms"] if r["prefetch"] else row["load_ms"]
                 for r in runs[name] for row in r["images"] if not row["cache_hit"]]  # fmt: skip
        loads = [row["load_ms"] for r in runs[name] for row in r["images"] if not row["cache_hit"]]
        print(f"{name}, routing pass: median load {statistics.median(loads):.3f} ms, "
              f"the image waited {statistics.median(waits):.3f} ms of it")  # fmt: skip


if __name__ == "__main__":
    main()
