"""ONNX Runtime, the paper's ViT-Ti/32 (E=10, k=1, L=2, 1000 classes): the bench's numbers against direct sessions.

    .venv/bin/python benchmarks/onnxruntime_vit_ti32.py [--bundles DIR] [--iterations N] [--threads T]

Exports (once, cached in --bundles) the dense ViT and the Mobile V-MoE split as ONNX, benchmarks both in ONE
`mobile-moe bench --runtime onnxruntime` run, then times the same graphs directly: one onnxruntime session per
graph at intra_op_num_threads=T, dense and MoE (router, then the chosen expert's path) alternating in blocks of 20
images. Prints MoE/dense p50 through the bench (goal <= 1.05) and directly, and the bench's p50 over the direct p50
for each model (goal: within 5%). Random weights and images: latency does not depend on their values. The host is
shared; rerun when the two ratios disagree.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from mobile_moe.device_bench.bench import bench_bundles
from mobile_moe.export.manifest import read_manifest
from mobile_moe.models.registry import create_model

MODELS = {"dense": "vit", "moe": "mobile-vmoe"}


def export_bundles(root: Path) -> dict[str, Path]:
    import torch

    from mobile_moe.export.bundle import export_bundle

    paths = {}
    for name, model_name in MODELS.items():
        paths[name] = root / name
        if not (paths[name] / "manifest.json").exists():
            torch.manual_seed(0)
            model = create_model(model_name, "12x192", num_classes=1000).eval()
            start = time.perf_counter()
            export_bundle(model, paths[name], "onnx")
            print(f"exported {name} in {time.perf_counter() - start:.0f} s")
    return paths


def session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def direct_runs(paths: dict[str, Path], images: np.ndarray, iterations: int, threads: int) -> dict[str, list[float]]:
    """ms per image for each model: blocks of 20 images per model, alternating models block by block, so drift hits
    both alike while each model runs with its own weights hot in cache, as it does in the bench's own process."""
    dense_manifest, moe_manifest = read_manifest(paths["dense"]), read_manifest(paths["moe"])
    dense = session(paths["dense"] / dense_manifest.graphs[0].file, threads)
    composition = moe_manifest.composition
    router = session(paths["moe"] / moe_manifest.graph(composition.router).file, threads)
    experts = [session(paths["moe"] / moe_manifest.graph(name).file, threads) for name in composition.experts]
    image_input = dense.get_inputs()[0].name
    token_input, gate_input = (node.name for node in experts[0].get_inputs())

    router_input = router.get_inputs()[0].name

    def run_moe(image: np.ndarray) -> None:
        tokens, probs = router.run(["tokens", "router_probs"], {router_input: image})
        expert = int(np.argmax(probs[0]))
        gate = np.asarray([[probs[0, expert]]], dtype=np.float32)
        experts[expert].run(["logits"], {token_input: tokens, gate_input: gate})

    def run_dense(image: np.ndarray) -> None:
        dense.run(["logits"], {image_input: image})

    for index in range(len(images)):  # warm-up: every image once, so every expert it picks has run
        run_dense(images[index][None])
        run_moe(images[index][None])
    times: dict[str, list[float]] = {"dense": [], "moe": []}
    for block in range(0, iterations, 20):
        for name, run in (("dense", run_dense), ("moe", run_moe)):
            for index in range(block, min(block + 20, iterations)):
                start = time.perf_counter()
                run(images[index % len(images)][None])
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundles", default="bench-vit-ti32-onnx")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    paths = export_bundles(Path(args.bundles))
    results = bench_bundles(list(paths.values()), Path(args.bundles) / "bench", runtime="onnxruntime",
                            iterations=args.iterations, warmup=5, threads=args.threads, log=lambda m: None)  # fmt: skip
    bench = {Path(run["bundle"]).name: run["latency_ms"]["p50"] for run in results["runs"]}
    images = np.random.default_rng(0).standard_normal((16, 3, 224, 224), dtype=np.float32)
    timed = direct_runs(paths, images, args.iterations, args.threads)
    direct = {name: statistics.median(ms) for name, ms in timed.items()}
    print("| | dense p50 ms | MoE p50 ms | MoE/dense |\n|---|---:|---:|---:|")
    for label, p50 in (("bench (onnxruntime)", bench), ("direct sessions", direct)):
        print(f"| {label} | {p50['dense']:.2f} | {p50['moe']:.2f} | {p50['moe'] / p50['dense']:.3f} |")
    print(f"\nbench / direct p50: dense {bench['dense'] / direct['dense']:.3f}, MoE {bench['moe'] / direct['moe']:.3f}")


if __name__ == "__main__":
    main()
