"""A measurement process around export's Python bundle runtime (ExecuTorch Python bindings or ONNX Runtime).

Run as `python -m device_bench.python_worker --bundle DIR --input FILE.f32 ...`, one fresh process per run (so the
cold load is cold and the memory high-water mark belongs to this bundle alone), it prints one JSON object with the
same keys as the native runner, so results.py treats every runner alike. Bundle loading is export.runtime's; this
file only times it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from device_bench.process_memory import memory_now
from mobile_moe.errors import UsageError


def summary(samples: list[float]) -> dict:
    values = np.asarray(samples, dtype=np.float64)
    return {
        "p50": float(np.percentile(values, 50)),
        "p90": float(np.percentile(values, 90)),
        "p99": float(np.percentile(values, 99)),
        "mean": float(values.mean()),
        "min": float(values.min()),
        "max": float(values.max()),
        "samples": [float(v) for v in values],
    }


def timed_predict(bundle, image) -> tuple[object, float, bool]:
    """(prediction, wall ms, whether every chosen expert was already loaded)."""
    loaded_before = set(bundle.loaded_graphs)
    start = time.perf_counter()
    prediction = bundle.predict(image)
    wall_ms = (time.perf_counter() - start) * 1e3
    hit = all(name in loaded_before for name in set(bundle.loaded_graphs) - {"router"})
    return prediction, wall_ms, hit


def measure(args: argparse.Namespace) -> dict:
    import torch

    from export.manifest import read_manifest
    from export.runtime import load_bundle

    shape = read_manifest(args.bundle)["input"]["shape"]  # the schema's checks; nothing is loaded before the timing
    images = torch.from_numpy(np.fromfile(args.input, dtype=np.float32).reshape(-1, *shape[1:]))  # (N, C, S, S)
    torch.set_num_threads(args.threads)
    cache = args.cache_experts
    report: dict = {"runner": f"python-{args.runtime}", "bundle": args.bundle, "threads": args.threads}
    report["memory_at_start"] = memory_now()

    start = time.perf_counter()
    bundle = load_bundle(args.bundle, max_cached_experts=cache, threads=args.threads)  # every session: --threads
    report["load_ms"] = {"router": (time.perf_counter() - start) * 1e3}
    report["memory_after_first_load"] = memory_now()

    # Routing pass: each image once, in order. A miss's extra wall time over its stages is the expert's cold load.
    rows, expert_load_ms = [], {}
    for image in images:
        prediction, wall_ms, hit = timed_predict(bundle, image[None])
        experts = [int(e) for e in prediction.experts]
        router_ms, load_ms = prediction.timings["router"], prediction.timings["load"]
        if not hit and experts and experts[0] not in expert_load_ms:
            expert_load_ms[experts[0]] = load_ms
        rows.append(
            {
                "experts": experts,
                "gates": [float(g) for g in prediction.gates],
                "logits": [float(v) for v in np.asarray(prediction.logits).reshape(-1)],
                "router_ms": router_ms,
                "load_ms": load_ms,
                "total_ms": wall_ms,
                "cache_hit": hit,
            }
        )
    report["images"] = rows
    report["graphs_loaded_after_routing"] = sorted(bundle.loaded_graphs)

    for i in range(args.warmup):
        bundle.predict(images[i % len(images)][None])
    total, router, expert = [], [], []
    for i in range(args.iterations):
        prediction, wall_ms, _ = timed_predict(bundle, images[i % len(images)][None])
        total.append(wall_ms)
        router.append(prediction.timings["router"])  # Prediction.timings: router, load, experts, total (ms)
        expert.append(prediction.timings["experts"])
    report["latency_ms"] = summary(total)
    report["stages_ms"] = {"router": summary(router), "expert": summary(expert)}
    report["memory_after_warm"] = memory_now()
    report["expert_load_ms"] = {str(e): ms for e, ms in expert_load_ms.items()}
    router_ms = statistics.median(router or [0.0])
    report["switch"] = measure_switch(args, images, rows, load_bundle, router_ms)
    report["memory_at_end"] = memory_now()
    return report


def measure_switch(args: argparse.Namespace, images, rows: list[dict], load_bundle, router_ms: float) -> dict:
    """With one cached expert, alternate images routed to different experts, --switch-repeats times over: every
    predict then switches (unloads one expert, loads and first-runs another)."""
    if args.switch_repeats == 0:
        return {"ms": [], "median_ms": None, "note": "--switch-repeats 0: switch timing off"}
    bundle = load_bundle(args.bundle, max_cached_experts=1, threads=args.threads)
    if bundle.layout in ("dense", "monolithic", "whole"):
        return {"ms": [], "median_ms": None, "note": "one graph holds every expert: there is no expert to switch"}
    by_expert: dict[int, int] = {}
    for index, row in enumerate(rows):
        if row["experts"]:
            by_expert.setdefault(row["experts"][0], index)
    if len(by_expert) < 2:
        return {"ms": [], "median_ms": None, "note": "the routing sequence uses one expert: no switch to time"}
    picks = list(by_expert.values())
    switch_ms = []
    for _repeat in range(args.switch_repeats):
        for index in picks:
            _, wall_ms, hit = timed_predict(bundle, images[index][None])
            if not hit:
                switch_ms.append(wall_ms - router_ms)
    return {"ms": switch_ms, "median_ms": statistics.median(switch_ms) if switch_ms else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--runtime", required=True, choices=["executorch", "onnxruntime", "coreml"])
    parser.add_argument("--input", required=True)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-experts", type=int, default=None)
    parser.add_argument("--switch-repeats", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        print(json.dumps(measure(args)))
    except UsageError as error:  # a bad bundle: one line, status 2, which the bench CLI passes on
        print(" ".join(str(error).split()), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
