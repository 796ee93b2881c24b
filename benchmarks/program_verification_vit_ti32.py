"""What ExecuTorch's program verification costs an expert switch, for the paper's ViT-Ti/32 Mobile V-MoE (12x192,
patch 32, 224 px, 1000 classes; E=10, k=1, L=2; XNNPACK), in ONE run on this host:

    .venv/bin/python benchmarks/program_verification_vit_ti32.py [--out DIR] [--repeats N]

Both runtimes load every program with `Verification::InternalConsistency` (mobile_moe/export/loaded_graphs.py,
libmobile_moe/src/graph_loader.h): ExecuTorch's Program::load (runtime/executor/program.cpp) then
runs the flatbuffers verifier (VerifyProgramBuffer) over the whole program before reading it; `Minimal` checks only
the header.
For each of the bundle's expert graphs, in the Python runtime (the same C++ Program::load as the native runner's), one
"switch" is timed as the runtime does it: load the program (and its weights file), load the method (XNNPACK packs the
weights), run it once. Each repetition times both verification levels in turn, for every expert; printed: the median
load_program time of each level, their difference (what verification adds), and that difference as a share of the
switch (the issue's goal: <= 5%), with its range over the experts. Weights and inputs are random:
load times do not depend on their values. Nothing else may run on the host meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from mobile_moe.export.bundle import export_bundle
from mobile_moe.export.manifest import read_manifest
from mobile_moe.models.registry import create_model


def export(out: Path) -> Path:
    if not (out / "manifest.json").exists():
        torch.manual_seed(0)
        export_bundle(create_model("mobile-vmoe", "12x192", num_classes=1000).eval(), out, "executorch")
    return out


def timed_switch(path: Path, weights: Path | None, inputs: list[torch.Tensor], verification) -> tuple[float, float]:
    """-> (seconds to load the program, seconds for the whole switch: program, method, one run)."""
    from executorch.runtime import Runtime

    runtime = Runtime.get()
    start = time.perf_counter()
    program = runtime.load_program(path, verification=verification, data_path=weights)
    loaded = time.perf_counter()
    program.load_method("forward").execute(inputs)
    return loaded - start, time.perf_counter() - start


def main() -> None:
    from executorch.runtime import Verification

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench-program-verification-vit-ti32"))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    bundle = export(args.out / "moe")
    manifest = read_manifest(bundle, verify_files=True)
    experts = [graph for graph in manifest.graphs if graph.loads_per_expert]
    levels = {"minimal": Verification.Minimal, "internal consistency": Verification.InternalConsistency}
    times: dict[str, dict[str, list[tuple[float, float]]]] = {level: {} for level in levels}
    for _ in range(args.repeats + 1):  # the first repetition warms the page cache and is not counted
        for graph in experts:
            inputs = [torch.from_numpy(np.random.default_rng(0).standard_normal(spec.shape, dtype=np.float32))
                      for spec in graph.inputs]  # fmt: skip
            weights = bundle / graph.weights.file if graph.weights is not None else None
            for level, verification in levels.items():
                times[level].setdefault(graph.name, []).append(
                    timed_switch(bundle / graph.file, weights, inputs, verification)
                )
    print(f"{len(experts)} expert graphs, {args.repeats} repetitions, medians per expert:")
    print("| expert | program bytes | load, minimal ms | load, verified ms | added ms | switch ms | share |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    added_all, switches = [], []
    for graph in experts:
        minimal, checked = ([t[0] for t in times[level][graph.name][1:]] for level in levels)
        switch = statistics.median(t[1] for t in times["internal consistency"][graph.name][1:])
        added = statistics.median(checked) - statistics.median(minimal)
        added_all.append(added)
        switches.append(switch)
        print(f"| {graph.name} | {graph.bytes} | {1e3 * statistics.median(minimal):.3f} | "
              f"{1e3 * statistics.median(checked):.3f} | {1e3 * added:.3f} | {1e3 * switch:.2f} | "
              f"{100 * added / switch:.2f}% |")  # fmt: skip
    added, switch = statistics.median(added_all), statistics.median(switches)
    print(f"verification adds {1e3 * added:.3f} ms per expert load (median over experts; range "
          f"{1e3 * min(added_all):.3f} to {1e3 * max(added_all):.3f} ms), {100 * added / switch:.2f}% of a "
          f"{1e3 * switch:.2f} ms switch; goal <= 5%")  # fmt: skip


if __name__ == "__main__":
    main()
