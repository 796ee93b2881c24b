"""Compression schemes for the paper's ViT-Ti/32 Mobile V-MoE (1000 classes, E=10, k=1, L=2; random weights, so
sizes and latency only, no accuracy), ExecuTorch, per-block layout (each expert graph is its MLP alone):

    python benchmarks/compression_vit_ti32.py [--iterations 50] [--rounds 3] [--out DIR]

For each --quantize scheme: bytes on disk, bytes resident for the router + shared graphs + one expert, and the native
runner's p50 and peak RSS (1 thread, `mobile-moe bench`'s measurement, rounds interleaved); the dense ViT-Ti/32 int8
beside them. Ratios are against the same MoE all int8, measured in the same run.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from mobile_moe.device_bench.bench import bench_bundles
from mobile_moe.export.bundle import export_bundle
from mobile_moe.models.registry import create_model

SCHEMES = ["none", "int8", "8da4w", "experts=8da4w,rest=int8", "experts=8da4w,rest=none"]


def paper_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The paper's ViT-Ti/32 Mobile V-MoE (1000 classes, E=10, k=1, L=2) and its dense twin, seeded random weights."""
    torch.manual_seed(0)
    moe = create_model("mobile-vmoe", "12x192", num_classes=1000).eval()
    return moe, create_model("vit", "12x192", num_classes=1000).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="keep the bundles and bench folder here (default: a temp dir)")
    args = parser.parse_args()
    moe, dense = paper_models()
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        bundles = {}
        for scheme in SCHEMES:
            path = out / f"moe-{scheme.replace(',', '+').replace('=', '-')}"
            bundles[scheme] = (path, export_bundle(moe, path, "executorch", quantize=scheme, layout="per-block"))
            print(f"exported {scheme}", flush=True)
        path = out / "dense-int8"
        bundles["dense int8"] = (path, export_bundle(dense, path, "executorch", quantize="int8"))
        results = bench_bundles([str(path) for path, _ in bundles.values()], out / "bench", runtime="native",
                                iterations=args.iterations, warmup=5, rounds=args.rounds)  # fmt: skip
        print_table(bundles, results)


def print_table(bundles: dict, results: dict) -> None:
    runs = {run["bundle"]: run for run in results["runs"]}
    base_path, base = bundles["int8"]
    base_run = runs[str(base_path)]
    dense_bytes = bundles["dense int8"][1].sizes["total_bytes"]
    print("\n| scheme | bundle MB | / all int8 | router + 1 expert MB | / dense int8 | p50 ms (rounds) | / all int8 "
          "| peak RSS MiB |\n|---|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for scheme, (path, manifest) in bundles.items():
        run = runs[str(path)]
        total, held = manifest.sizes["total_bytes"], manifest.sizes.get("resident_plus_one_expert_bytes")
        held = held or total  # a dense bundle: its one graph
        rounds = ", ".join(f"{p:.2f}" for p in run["spread"]["latency_p50_ms"])
        print(f"| {scheme} | {total / 1e6:.2f} | {total / base.sizes['total_bytes']:.3f} | {held / 1e6:.2f} "
              f"| {held / dense_bytes:.3f} | {run['latency_ms']['p50']:.2f} ({rounds}) "
              f"| {run['latency_ms']['p50'] / base_run['latency_ms']['p50']:.3f} "
              f"| {(run['peak_rss_bytes'] or 0) / 2**20:.1f} |")  # fmt: skip
    print(f"\nmedians of {len(base_run['spread']['latency_p50_ms'])} interleaved rounds; "
          f"{results['runs'][0]['threads']} thread; {results['host']}")


if __name__ == "__main__":
    main()
