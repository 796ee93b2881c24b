"""Router + one expert against the dense model: peak RSS through the library's defaults, every round, across model
sizes, in ONE run on this host:

    .venv/bin/python benchmarks/split_memory.py [--out DIR] [--rounds R] [--iterations N]

For each shape (the README's own-folder model: ViT-Ti/32, 6 classes, 3 experts; the paper's ViT-Ti/32, 1,000
classes, E=10; both k=1, L=2, random weights, and the dense ViT of the same size beside each), examples/app_example.c
(`mobile_moe_app`: an app's whole use of the C API, no option set) predicts N images of a stream whose expert changes
on every image where the bundle has the experts (benchmarks/expert_switch_vit_ti32.py's stream). One process per
bundle and round, interleaved; the default packed-weight folder is MOBILE_MOE_WEIGHT_CACHE, pointed into --out: a
first launch (an empty folder) and R second launches (the folder warm). Printed per shape: every round's peak RSS
(VmHWM) of both, the highest warm round's ratio (the highest MoE round over the highest dense round) and the worst
(the highest MoE round over the lowest dense round), the first launch's ratio; and the MoE's rounds with evicted
experts unloaded (`--park-experts 0`), which shows what the parked experts hold. Nothing else may run on the host.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
from pathlib import Path

from mobile_moe.library.build import build_library

sys.path.insert(0, str(Path(__file__).resolve().parent))
from expert_switch_vit_ti32 import export, switching_stream  # noqa: E402
from library_vit_ti32 import app  # noqa: E402

SHAPES = {  # name: (classes, experts)
    "vit-ti32-6-classes-3-experts": (6, 3),
    "vit-ti32-1000-classes-10-experts": (1000, 10),
}
MIB = 2**20


def peak_rss(binary: Path, bundle: Path, images: Path, iterations: int, folder: Path, *flags: str) -> float:
    """One app process with the library's defaults (but `flags`); its peak RSS in MiB."""
    return app(binary, bundle, images, iterations, defaults_folder=folder, flags=flags)["peak_rss_bytes"] / MIB


def measure(binary: Path, out: Path, classes: int, experts: int, rounds: int, iterations: int) -> dict:
    moe = export(out / "moe", "mobile-vmoe", num_classes=classes, num_experts=experts)
    dense = export(out / "dense", "vit", num_classes=classes)
    stream = out / "stream.f32"
    rate = switching_stream(moe, stream)
    first: dict[str, float] = {}
    warm: dict[str, list[float]] = {"moe": [], "dense": [], "moe, park_experts 0": []}
    for name, bundle in (("moe", moe), ("dense", dense)):
        folder = out / f"packed-weights-{name}"
        shutil.rmtree(folder, ignore_errors=True)
        first[name] = peak_rss(binary, bundle, stream, iterations, folder)
    for _ in range(rounds):
        for name, bundle in (("moe", moe), ("dense", dense)):
            warm[name].append(peak_rss(binary, bundle, stream, iterations, out / f"packed-weights-{name}"))
        parked_none = peak_rss(binary, moe, stream, iterations, out / "packed-weights-moe", "--park-experts", "0")
        warm["moe, park_experts 0"].append(parked_none)
    return {"change_rate": rate, "first": first, "warm": warm,
            "highest": max(warm["moe"]) / max(warm["dense"]), "worst": max(warm["moe"]) / min(warm["dense"]),
            "highest_parking_none": max(warm["moe, park_experts 0"]) / max(warm["dense"]),
            "first_ratio": first["moe"] / first["dense"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench-split-memory"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=36)
    args = parser.parse_args()
    binary = build_library().parent / "mobile_moe_app"
    print(f"{platform.node()}: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; {args.rounds} warm rounds of "
          f"{args.iterations} predictions, one process per bundle and round")  # fmt: skip
    for shape, (classes, experts) in SHAPES.items():
        figures = measure(binary, args.out / shape, classes, experts, args.rounds, args.iterations)
        print(f"\n{shape} (expert change rate {figures['change_rate']:.2f})")
        for name, values in figures["warm"].items():
            first = f"first launch {figures['first'][name]:.2f}; " if name in figures["first"] else ""
            print(f"  {name} peak RSS MiB: {first}warm rounds {', '.join(f'{value:.2f}' for value in values)}")
        print(f"  router + one expert / dense: highest round {figures['highest']:.4f}, worst pairing "
              f"{figures['worst']:.4f}, first launch {figures['first_ratio']:.4f}; evicted experts unloaded "
              f"(park_experts 0), highest round {figures['highest_parking_none']:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
