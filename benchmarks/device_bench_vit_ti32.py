"""The paper's ViT-Ti/32 (12x192, patch 32, 224 px, 1000 classes; Mobile V-MoE E=10, k=1, L=2) on the native runner.

    .venv/bin/python benchmarks/device_bench_vit_ti32.py [--bundles DIR] [--out DIR] [--rounds R] [--iterations N]

Exports (once, cached in --bundles) the dense ViT, the Mobile V-MoE split into router + expert paths, the same split
per block (shared block halves resident, expert MLPs only per expert), and the monolithic graph; then benchmarks all
of them in ONE bench run (native runner, 1 thread) and prints: dense p50, MoE end-to-end p50 and their ratio (goal
<= 1.03), expert switch cost vs a warm run (goal <= 2x), graph bytes loaded per image vs active parameter bytes (goal
<= +2%), split vs monolithic memory. Models are randomly initialised (latency and memory do not depend on the weights'
values); inputs are random images. The host is shared: numbers are noisy, read the spread column. There is no pass
with XNNPACK's packed-weight cache: an ExecuTorch bundle's experts share one program, and the native runner refuses
the cache for such bundles (it keys packed weights by name).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mobile_moe.device_bench.bench import BenchSettings, benchmark
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.models.registry import create_model

VARIANTS = {  # bundle name -> (model, export options)
    "dense": ("vit", {}),
    "moe": ("mobile-vmoe", {}),
    "moe-perblock": ("mobile-vmoe", {"layout": "per-block"}),
    "moe-monolithic": ("mobile-vmoe", {"monolithic": True}),
}


def export_bundles(root: Path) -> list[Path]:
    from mobile_moe.export.bundle import export_bundle

    paths = []
    for name, (model_name, options) in VARIANTS.items():
        path = root / name
        if not (path / "manifest.json").exists():
            torch.manual_seed(0)
            model = create_model(model_name, "12x192").eval()
            start = time.perf_counter()
            export_bundle(model, path, "executorch", **options)
            print(f"exported {name} in {time.perf_counter() - start:.0f} s")
        paths.append(path)
    return paths


def bench(paths: list[Path], out: Path, rounds: int, iterations: int) -> dict:
    round_settings = RoundSettings(iterations=iterations, warmup=10, threads=1)
    settings = BenchSettings(round_settings, runtime="native", rounds=rounds, pause_s=1.0, images=32)
    return benchmark(paths, settings, out, log=lambda message: None)


def headline(results: dict, label: str) -> dict:
    runs = {run["bundle_name"]: run for run in results["runs"]}
    dense, moe, mono, block = runs["dense"], runs["moe"], runs["moe-monolithic"], runs["moe-perblock"]
    mib = 2**20
    print(f"\n== {label} ==")
    for name, run in runs.items():
        spread = f"spread {run['spread']['relative']:.0%}{' WIDE' if run['spread']['wide'] else ''}"
        switch = f", switch {run['switch_ms']:.2f} ms (load {run['switch']['load_ms']:.2f})" if run["switch_ms"] else ""
        print(
            f"{name:15s} p50 {run['latency_ms']['p50']:7.2f} ms  p90 {run['latency_ms']['p90']:7.2f}  "
            f"cold load {run['load_ms']['router']:6.1f} ms{switch}; peak RSS {run['peak_rss_bytes'] / mib:6.1f} MiB, "
            f"PSS {run['pss_bytes'] / mib:6.1f} MiB; graph bytes/image {run['bytes_loaded_per_image'] / mib:5.2f} MiB; "
            f"{spread}"
        )
    numbers = {
        "dense_p50_ms": dense["latency_ms"]["p50"],
        "moe_p50_ms": moe["latency_ms"]["p50"],
        "moe_vs_dense_p50": moe["latency_ms"]["p50"] / dense["latency_ms"]["p50"],
        "perblock_vs_dense_p50": block["latency_ms"]["p50"] / dense["latency_ms"]["p50"],
        "switch_ms": moe["switch_ms"],
        "switch_vs_warm_p50": moe["switch_ms"] / moe["latency_ms"]["p50"],
        "perblock_switch_vs_warm_p50": block["switch_ms"] / block["latency_ms"]["p50"],
        "bytes_per_image_vs_active_params": moe["bytes_loaded_vs_active_params"],
        "perblock_bytes_per_image_vs_active_params": block["bytes_loaded_vs_active_params"],
        "split_peak_rss_mib": moe["peak_rss_bytes"] / mib,
        "monolithic_peak_rss_mib": mono["peak_rss_bytes"] / mib,
        "split_vs_monolithic_peak_rss": moe["peak_rss_bytes"] / mono["peak_rss_bytes"],
    }
    print(
        f"dense p50 {numbers['dense_p50_ms']:.2f} ms; MoE end-to-end p50 {numbers['moe_p50_ms']:.2f} ms; "
        f"ratio {numbers['moe_vs_dense_p50']:.3f} (goal <= 1.03; per-block {numbers['perblock_vs_dense_p50']:.3f})"
    )
    print(
        f"expert switch {numbers['switch_ms']:.2f} ms = {numbers['switch_vs_warm_p50']:.2f}x a warm run (goal <= 2x; "
        f"per-block {numbers['perblock_switch_vs_warm_p50']:.2f}x)"
    )
    print(
        f"graph bytes per image / active parameter bytes (fp32) = {numbers['bytes_per_image_vs_active_params']:.4f} "
        f"(goal <= 1.02; per-block {numbers['perblock_bytes_per_image_vs_active_params']:.4f})"
    )
    print(
        f"peak RSS split {numbers['split_peak_rss_mib']:.1f} MiB vs monolithic "
        f"{numbers['monolithic_peak_rss_mib']:.1f} MiB ({numbers['split_vs_monolithic_peak_rss']:.2f}x)"
    )
    return numbers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundles", default=str(Path.home() / ".cache/mobile-moe/bench-vit-ti32"))
    parser.add_argument("--out", default="bench-vit-ti32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=100)
    args = parser.parse_args()
    paths = export_bundles(Path(args.bundles))
    label = "default runtime settings"
    summary = {label: headline(bench(paths, Path(args.out) / "default", args.rounds, args.iterations), label)}
    Path(args.out, "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
