"""Training throughput of Mobile V-MoE over the dense ViT of the same backbone on a GPU, eager and torch.compile'd.

    python benchmarks/gpu_train_step.py                 # DeiT-Ti/16, 224 px, 1000 classes, E=10, k=1, L=2, batch 256,
                                                        # bf16 autocast; dense and MoE, eager and compiled
    python benchmarks/gpu_train_step.py --no-compile    # eager only (or --compile-only; --json: one JSON object)
    python benchmarks/gpu_train_step.py --device cpu --size 4x64 --patch 8 --image-size 32 --num-classes 10 \
        --experts 5 --batch-size 16 --steps 3 --warmup 1 --no-compile   # CPU smoke check (fp32), seconds

Each step is train_step.py's (forward + router loss + backward + AdamW) on one fixed batch; in each mode steps alternate
dense, MoE, dense, ... so drift in clocks and load hits both alike, and medians are compared. Expected: MoE/dense
throughput close to 1 (train_step.py's CPU goal, time <= 1.10x, is >= 0.91 here): per-image routing runs k expert MLPs
per image, not E. Compiled MoE may gain less than dense: reading group sizes (moe.py's bincount) breaks the graph, and
new group sizes (0 and 1 are specialised) recompile it. "timed compiles" > 0 means compilation hit the timed steps:
raise --warmup (after dynamo's recompile limit, 8 per frame, the dispatch frames run eager and the churn stops).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
from torch import nn
from torch._dynamo.utils import counters as dynamo_counters  # private, but where dynamo counts the graphs it compiles

# Python puts this script's directory first on sys.path, so the CPU benchmark's step is shared, not copied.
from train_step import train_step

from mobile_moe.outputs import ModelOutput
from mobile_moe.registry import create_model, make_config

MODES = ("eager", "compiled")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--size", default="deit-ti")
    parser.add_argument("--patch", type=int, help="patch size (default: the size preset's, else the model's)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--experts", type=int, default=10)
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--moe-layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per model (compilation happens here)")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--no-compile", action="store_true", help="eager only")
    modes.add_argument("--compile-only", action="store_true", help="torch.compile only")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of markdown")
    return parser.parse_args()


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        print("CUDA requested but not available; use --device cpu for a smoke run", file=sys.stderr)
        sys.exit(2)
    return torch.device(name)


class Bf16Forward(nn.Module):
    """The model's forward under bf16 autocast, logits back in fp32: AMP's recipe (autocast the forward, not backward or
    the optimizer) while train_step stays shared. Cross-entropy would run in fp32 under autocast too."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> ModelOutput:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = self.model(images)
        routing = None if out.routing is None else out.routing._replace(logits=out.routing.logits.float())
        return out._replace(logits=out.logits.float(), routing=routing)


def build_pair(args: argparse.Namespace, device: torch.device, compiled: bool) -> dict:
    """{"dense"|"moe": (callable model, optimizer)}, from the same seed in every mode so both modes train alike."""
    torch.manual_seed(0)
    shape = {"patch_size": args.patch, "image_size": args.image_size, "num_classes": args.num_classes}
    moe_fields = {"num_experts": args.experts, "top_k": args.top_k, "moe_layers": args.moe_layers}
    pair = {}
    for name, model in (
        ("dense", create_model("vit", args.size, **shape)),
        ("moe", create_model("mobile-vmoe", args.size, **shape, **moe_fields)),
    ):
        model = model.to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runnable = Bf16Forward(model) if device.type == "cuda" else model  # CPU: fp32, as train_step.py
        pair[name] = (torch.compile(runnable) if compiled else runnable, optimizer)
    return pair


def time_pair(pair: dict, batch: tuple, args: argparse.Namespace, device: torch.device) -> dict:
    """Alternating steps -> {name: {"seconds": per timed step, "peak": CUDA bytes, "timed_compiles": graphs}}."""
    cuda = device.type == "cuda"
    stats = {name: {"seconds": [], "peak": 0, "timed_compiles": 0} for name in pair}
    for step in range(args.warmup + args.steps):
        for name, (model, optimizer) in pair.items():
            if cuda:  # reset per step so each peak is this model's step (both models' weights stay resident)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            graphs = dynamo_counters["stats"]["unique_graphs"]
            start = time.perf_counter()
            train_step(model, optimizer, *batch)
            if cuda:  # kernels launch asynchronously: the step ends when the device is done
                torch.cuda.synchronize()
                stats[name]["peak"] = max(stats[name]["peak"], torch.cuda.max_memory_allocated(device))
            if step >= args.warmup:
                stats[name]["seconds"].append(time.perf_counter() - start)
                stats[name]["timed_compiles"] += dynamo_counters["stats"]["unique_graphs"] - graphs
    return stats


def summarize(stats: dict, batch_size: int) -> dict:
    ordered = sorted(stats["seconds"])
    median = statistics.median(ordered)
    p90 = ordered[math.ceil(0.9 * len(ordered)) - 1]  # nearest rank: defined for any number of steps
    return {
        "median_ms": median * 1e3,
        "p90_ms": p90 * 1e3,
        "images_per_s": batch_size / median,
        "peak_mib": stats["peak"] / 2**20 if stats["peak"] else None,
        "timed_compiles": stats["timed_compiles"],
    }


def ratios(results: dict) -> dict:
    """MoE/dense throughput per mode, and compiled/eager speed-up per model, where both sides were measured."""
    speed = {key: value["images_per_s"] for key, value in results.items()}
    pairs = {f"moe/dense {mode}": (f"moe-{mode}", f"dense-{mode}") for mode in MODES}
    pairs |= {f"compiled/eager {model}": (f"{model}-compiled", f"{model}-eager") for model in ("dense", "moe")}
    return {name: speed[a] / speed[b] for name, (a, b) in pairs.items() if a in speed and b in speed}


def print_markdown(report: dict) -> None:
    print(f"{report['device']}, torch {report['torch']}, {report['precision']}, {report['setup']}\n")
    print("| variant | median ms/step | p90 ms/step | images/s | peak MiB | timed compiles |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in report["variants"].items():
        peak = "-" if row["peak_mib"] is None else f"{row['peak_mib']:.0f}"
        times = f"{row['median_ms']:.1f} | {row['p90_ms']:.1f} | {row['images_per_s']:.0f}"
        print(f"| {name} | {times} | {peak} | {row['timed_compiles']} |")
    print("\n| ratio (throughput) | value |\n|---|---:|")
    for name, value in report["ratios"].items():
        print(f"| {name} | {value:.3f}x |")


def measure(args: argparse.Namespace, device: torch.device, modes: tuple[str, ...]) -> dict:
    """{"dense-eager": summary, "moe-eager": ..., "dense-compiled": ..., ...} for the chosen modes."""
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, args.num_classes, (args.batch_size,), device=device)
    super_labels = labels % args.experts  # planted super-classes so the router spreads images over experts
    results = {}
    for mode in modes:
        pair = build_pair(args, device, compiled=mode == "compiled")
        stats = time_pair(pair, (images, labels, super_labels), args, device)
        for name in pair:
            results[f"{name}-{mode}"] = summarize(stats[name], args.batch_size)
        del pair  # free this mode's weights and optimizer state before the next mode measures its peaks
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def describe(args: argparse.Namespace, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    patch = make_config("vit", args.size, patch_size=args.patch).patch_size  # the preset's unless --patch
    return {
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "precision": "bf16 autocast" if cuda else "fp32",
        "setup": f"{args.size}/{patch} @{args.image_size}, {args.num_classes} classes, E={args.experts} k={args.top_k} "
        f"L={args.moe_layers}, batch {args.batch_size}, {args.warmup} warm-up + {args.steps} timed steps",
    }


def main() -> None:
    args = parse_args()
    device = pick_device(args.device)
    modes = ("eager",) if args.no_compile else ("compiled",) if args.compile_only else MODES
    results = measure(args, device, modes)
    report = {**describe(args, device), "variants": results, "ratios": ratios(results)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_markdown(report)


if __name__ == "__main__":
    main()
