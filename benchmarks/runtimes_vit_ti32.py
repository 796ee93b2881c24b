"""Every runtime against the dense model, for the paper's ViT-Ti/32 (12x192, patch 32, 224 px, 1000 classes; Mobile
V-MoE E=10, k=1, L=2), measured in ONE run on this host:

    .venv/bin/python benchmarks/runtimes_vit_ti32.py [--out DIR] [--iterations N] [--rounds R]

1. Export time, MoE / dense, ExecuTorch fp32 and int8 (goal <= 1.5): each bundle exported fresh and timed.
2. Disk: bundle bytes / parameter bytes (fp32: 4 bytes per parameter; goal <= 1.05).
3. Native runner, 1 thread: MoE / dense p50 (goal <= 1.03), and peak RSS split / dense per expert-cache size (one
   expert: goal <= 1.05; all experts: the default, which grows by one expert graph per expert touched).
4. ONNX Runtime, 1 thread: MoE / dense p50 through `mobile-moe bench` (goal <= 1.05), and the bench's p50 against
   direct onnxruntime sessions timing the same graphs (benchmarks/onnxruntime_vit_ti32.py; goal: within 5%).

Weights are random (latency, memory and size do not depend on their values); images are random. Nothing else may run
on the host meanwhile: the ratios compare runs made minutes apart. Writes DIR/summary.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from onnxruntime_vit_ti32 import direct_runs

from mobile_moe.device_bench.bench import BenchSettings, benchmark
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.export.bundle import export_bundle
from mobile_moe.models.costs import costs
from mobile_moe.models.registry import create_model, make_config

MODELS = {"dense": "vit", "moe": "mobile-vmoe"}


def export_timed(name: str, backend: str, quantize: str, out: Path) -> tuple[float, dict]:
    torch.manual_seed(0)
    model = create_model(MODELS[name], "12x192", num_classes=1000).eval()
    start = time.perf_counter()
    manifest = export_bundle(model, out, backend, quantize=quantize)
    seconds = time.perf_counter() - start
    print(f"exported {name} {backend} {quantize}: {seconds:.0f} s, {manifest.bundle_bytes() / 1e6:.1f} MB")
    return seconds, manifest


def bench(paths: dict[str, Path], out: Path, runtime: str, cache_experts: int | None, args) -> dict[str, dict]:
    """{bundle name: its run} from ONE bench run over every bundle in `paths`."""
    every = 0 if cache_experts is None else cache_experts  # None: every expert kept loaded
    round_settings = RoundSettings(args.iterations, 10, threads=1, cache_experts=every)
    settings = BenchSettings(round_settings, runtime=runtime, rounds=args.rounds, pause_s=1.0, images=32)
    results = benchmark(list(paths.values()), settings, out, log=lambda message: None)
    return {Path(run["bundle"]).name: run for run in results["runs"]}


Goal = tuple[str, float, str]  # (what, measured ratio, goal)


def export_goals(root: Path) -> tuple[list[Goal], dict[str, float]]:
    """Export time MoE/dense for fp32 and int8, and bundle bytes against fp32 parameter bytes; the export seconds."""
    goals, seconds, manifests = [], {}, {}
    for quantize in ("none", "int8"):
        for name in MODELS:
            key = f"{name}-{quantize}"
            seconds[key], manifests[key] = export_timed(name, "executorch", quantize, root / "executorch" / key)
        export_ratio = seconds[f"moe-{quantize}"] / seconds[f"dense-{quantize}"]
        goals.append((f"export time MoE/dense, {quantize}", export_ratio, "<= 1.5"))
    for name in MODELS:
        params = costs(make_config(MODELS[name], "12x192", num_classes=1000)).params_total
        disk_ratio = manifests[f"{name}-none"].bundle_bytes() / (4 * params)
        goals.append((f"bundle bytes / fp32 parameter bytes, {name}", disk_ratio, "<= 1.05"))
    return goals, seconds


def native_goals(root: Path, args) -> list[Goal]:
    """p50, peak RSS and RSS after warm-up, MoE/dense, per expert-cache size; the switch against a warm run."""
    goals = []
    native = {name: root / "executorch" / f"{name}-none" for name in MODELS}
    for cache in (1, None):
        runs = bench(native, root / f"bench-native-cache-{cache or 'all'}", "native", cache, args)
        moe, dense = runs["moe-none"], runs["dense-none"]
        label = f"cache {cache or 'all'}"
        p50 = moe["latency_ms"]["p50"] / dense["latency_ms"]["p50"]
        goals.append((f"native p50 MoE/dense, {label}", p50, "<= 1.03" if cache is None else "(switches included)"))
        if cache is None:
            switch = moe["switch_ms"] / moe["latency_ms"]["p50"]
            goals.append(("native expert switch / warm MoE p50", switch, "(report)"))
        peak = moe["peak_rss_bytes"] / dense["peak_rss_bytes"]
        goals.append((f"native peak RSS split/dense, {label}", peak, "<= 1.05" if cache == 1 else "(report)"))
        moe_warm, dense_warm = (run["raw_first_round"]["memory_after_warm"]["rss_bytes"] for run in (moe, dense))
        goals.append((f"native RSS after warm-up split/dense, {label}", moe_warm / dense_warm, "(report)"))
    return goals


def onnxruntime_goals(root: Path, args) -> list[Goal]:
    """MoE/dense p50 through the bench and in direct sessions, and the bench against direct sessions per model."""
    onnx = {name: root / "onnx" / name for name in MODELS}
    for name, path in onnx.items():
        export_timed(name, "onnx", "none", path)
    runs = bench(onnx, root / "bench-onnxruntime", "onnxruntime", None, args)
    bench_p50 = {name: runs[name]["latency_ms"]["p50"] for name in MODELS}
    images = np.random.default_rng(0).standard_normal((16, 3, 224, 224), dtype=np.float32)
    direct = {name: statistics.median(ms) for name, ms in direct_runs(onnx, images, args.iterations, 1).items()}
    goals = [
        ("onnxruntime bench p50 MoE/dense", bench_p50["moe"] / bench_p50["dense"], "<= 1.05"),
        ("onnxruntime direct p50 MoE/dense", direct["moe"] / direct["dense"], "(report)"),
    ]
    for name in MODELS:
        goals.append((f"onnxruntime bench / direct p50, {name}", bench_p50[name] / direct[name], "0.95..1.05"))
    return goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-runtimes-vit-ti32")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = Path(args.out)
    goals, seconds = export_goals(root)
    goals += native_goals(root, args) + onnxruntime_goals(root, args)
    print("\n| measure | ratio | goal |\n|---|---:|---|")
    for what, value, goal in goals:
        print(f"| {what} | {value:.3f} | {goal} |")
    summary = {"export_seconds": seconds, "ratios": {what: value for what, value, _ in goals}}
    (root / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
