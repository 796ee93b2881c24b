"""A measurement process around export's load_bundle: an ExecuTorch bundle in libmobile_moe through its Python binding
(the library an app links, in this process), an ONNX bundle in ONNX Runtime.

`PythonWorker(runtime).run_round(...)` runs `python -m mobile_moe.device_bench.python_worker --bundle DIR ...`,
one fresh process per round (so the cold load is cold and the memory high-water mark belongs to this bundle alone),
which prints one JSON object: a RoundReport (round_report.py), as the native runner does, so results.py treats every
runner alike. Bundle loading is export.runtime's; this file only times it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mobile_moe.device_bench.process_memory import memory_now
from mobile_moe.device_bench.round_report import RoundJson
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.errors import RuntimeFailure, UsageError
from mobile_moe.export.manifest import read_manifest
from mobile_moe.export.runtime import load_bundle
from mobile_moe.library.options import OPTIONS, from_args
from mobile_moe.utils.interrupts import die_with_parent, run_child


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
    start = time.perf_counter()
    prediction = bundle.predict(image)
    wall_ms = (time.perf_counter() - start) * 1e3
    return prediction, wall_ms, prediction.cache_hit


class ImageFile:
    """The images of a raw float32 file (N x C x S x S), read one at a time as they are asked for: the process holds
    one image whatever N is, so its peak memory is the model's, as the native runner's is (its ImageStream)."""

    def __init__(self, path: str | Path, shape: list[int]):
        self.path, self.shape = Path(path), tuple(shape[1:])
        self.values = int(np.prod(self.shape))
        self.count = self.path.stat().st_size // (4 * self.values)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.count:
            raise IndexError(index)
        image = np.fromfile(self.path, dtype=np.float32, count=self.values, offset=4 * self.values * index)
        return torch.from_numpy(image.reshape(self.shape))


def measure(bundle_dir: str | Path, runtime: str, images_file: str | Path, settings: RoundSettings) -> RoundJson:
    """One round on `bundle_dir` in this process: cold load, routing pass, timed warm runs, expert switches."""
    shape = read_manifest(bundle_dir).input.shape  # the schema's checks; nothing is loaded before the timing
    images = ImageFile(images_file, shape)
    if settings.threads > 0:  # 0: the runtime's own pool, as it is
        torch.set_num_threads(settings.threads)
    report: dict = {"runner": f"python-{runtime}", "bundle": str(bundle_dir), "threads": settings.threads}
    report["memory_at_start"] = memory_now()

    start = time.perf_counter()
    bundle = load_bundle(bundle_dir, **settings.library_options())
    report["load_ms"] = {"router": (time.perf_counter() - start) * 1e3}
    report["cache_experts"] = bundle.experts_kept
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
                "expert_ms": prediction.timings["experts"],
                "load_ms": load_ms,
                "total_ms": wall_ms,
                "cache_hit": hit,
            }
        )
    report["images"] = rows
    report["graphs_loaded_after_routing"] = sorted(bundle.loaded_graphs)

    for i in range(settings.warmup):
        bundle.predict(images[i % len(images)][None])
    total, router, expert = [], [], []
    for i in range(settings.iterations):
        prediction, wall_ms, _ = timed_predict(bundle, images[i % len(images)][None])
        total.append(wall_ms)
        router.append(prediction.timings["router"])  # Prediction.timings: router, load, experts, total (ms)
        expert.append(prediction.timings["experts"])
    report["latency_ms"] = summary(total)
    report["stages_ms"] = {"router": summary(router), "expert": summary(expert)}
    report["memory_after_warm"] = memory_now()
    report["expert_load_ms"] = {str(e): ms for e, ms in expert_load_ms.items()}
    router_ms = statistics.median(router or [0.0])
    report["switch"] = measure_switch(bundle_dir, settings, images, rows, load_bundle, router_ms)
    report["memory_at_end"] = memory_now()
    return report


def no_switch(note: str) -> dict:
    return {"ms": [], "median_ms": None, "load_median_ms": None, "first_run_median_ms": None,
            "warm_expert_run_median_ms": None, "note": note}  # fmt: skip


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure_switch(
    bundle_dir, settings: RoundSettings, images, rows: list[dict], load_bundle, router_ms: float
) -> dict:
    """With one cached expert, alternate images routed to different experts, --switch-repeats times over: every
    predict then switches (unloads one expert, loads and first-runs another); the same image once more right after
    is that expert's warm run."""
    if settings.switch_repeats == 0:
        return no_switch("--switch-repeats 0: switch timing off")
    bundle = load_bundle(bundle_dir, **(settings.library_options() | {"cache_experts": 1}))
    if bundle.layout in ("dense", "monolithic", "whole"):
        return no_switch("one graph holds every expert: there is no expert to switch")
    by_expert: dict[int, int] = {}
    for index, row in enumerate(rows):
        if row["experts"]:
            by_expert.setdefault(row["experts"][0], index)
    if len(by_expert) < 2:
        return no_switch("the routing sequence uses one expert: no switch to time")
    picks = list(by_expert.values())
    switch_ms, load_ms, first_run_ms, warm_run_ms = [], [], [], []
    for _repeat in range(settings.switch_repeats):
        for index in picks:
            prediction, wall_ms, hit = timed_predict(bundle, images[index][None])
            if not hit:
                switch_ms.append(wall_ms - router_ms)
                load_ms.append(prediction.timings["load"])
                first_run_ms.append(prediction.timings["experts"])
                warm_run_ms.append(bundle.predict(images[index][None]).timings["experts"])  # a hit: cache of one
    return {
        "ms": switch_ms,
        "median_ms": _median_or_none(switch_ms),
        "load_median_ms": _median_or_none(load_ms),
        "first_run_median_ms": _median_or_none(first_run_ms),
        "warm_expert_run_median_ms": _median_or_none(warm_run_ms),
    }


def worker_command(bundle: str | Path, runtime: str, images: str | Path, settings: RoundSettings) -> list[str]:
    command = [sys.executable, "-m", "mobile_moe.device_bench.python_worker"]
    command += ["--bundle", str(bundle), "--runtime", runtime]
    return [*command, "--input", str(images), *settings.runner_flags()]  # the native runner's flags, parsed below


@dataclass(frozen=True)
class PythonWorker:
    """export's load_bundle (libmobile_moe for ExecuTorch, ONNX Runtime) in a fresh interpreter per round."""

    runtime: str

    @property
    def name(self) -> str:
        return f"{self.runtime} worker"

    def run_round(self, bundle: Path, images: Path, settings: RoundSettings) -> RoundJson:
        command = worker_command(bundle, self.runtime, images, settings)
        result = run_child(command, capture_output=True)
        stderr = result.stderr.decode(errors="replace").strip().splitlines()
        if result.returncode == 2:  # the worker's one line for a bad bundle
            raise UsageError(stderr[-1] if stderr else f"{self.name} refused {bundle}")
        if result.returncode != 0:
            raise RuntimeError(f"{self.name} failed on {bundle} (status {result.returncode}): {stderr[-1:]}")
        return json.loads(result.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--runtime", required=True, choices=["executorch", "onnxruntime", "coreml"])
    parser.add_argument("--input", required=True)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--switch-repeats", type=int, default=2)
    for option in OPTIONS:  # the native runner's flags for them (RoundSettings.runner_flags)
        option.add_flag(parser)
    args = parser.parse_args(argv)
    try:
        settings = RoundSettings(
            iterations=args.iterations, warmup=args.warmup, switch_repeats=args.switch_repeats,
            **from_args(args),
        )  # fmt: skip
        print(json.dumps(measure(args.bundle, args.runtime, args.input, settings)))
    # One line, which the bench CLI passes on: status 2 for a bad bundle, 1 where the runtime failed.
    except (UsageError, RuntimeFailure) as error:
        print(" ".join(str(error).split()), file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1
    return 0


if __name__ == "__main__":
    die_with_parent()
    sys.exit(main())
