"""Training-step time of every registry model against the dense ViT of the same backbone, eager and torch.compile'd,
measured in one run.

    python benchmarks/train_step.py                     # CPU, ViT-Ti/32 @224, batch 64, E=10, L=2: every model, eager
    python benchmarks/train_step.py --compile           # eager and compiled (compile_model, inductor)
    python benchmarks/train_step.py --compile --models vit mobile-vmoe --steps 20
    python benchmarks/train_step.py --device cuda --size deit-ti --patch 16 --batch-size 256 --compile  # a GPU, bf16
    python benchmarks/train_step.py --device cuda --compile --cuda-graphs --anchor   # + CUDA graphs, + timm's anchor
    python benchmarks/train_step.py --device cuda --compile --profile --models vit mobile-vmoe   # + where time goes

A step is training's own (mobile_moe/training/engine.py: forward_loss under bf16 autocast on CUDA, then update:
backward, grad clip, AdamW, schedule) with the deit recipe's router loss against planted super-classes (label mod E), so
Mobile V-MoE's router spreads the images as training does. Within a mode the models take turns step by step (vit,
mobile-vmoe, ..., vit, ...), so drift in machine load hits them alike; ratios compare medians. The goals (issue 48's)
close the report: on the CPU, eager Mobile V-MoE / eager dense <= 1.03x. "timed compiles" > 0 means
a graph was compiled during the timed steps (a recompile): compiled training should have none; "first step s" is the
first warm-up step, where compiling happens. "per FLOP" divides a model's step-time ratio to the dense model by its
FLOPs ratio (mobile_moe.models.costs, per image): 1.0 means the model costs what its arithmetic says. The optimiser is
training's (mobile_moe/training/train.py adamw: fused, on the CPU too).

--anchor adds timm's deit_tiny_patch16_224 (at the benchmark's size: its width, depth, heads, patch and image size)
against our vit in a plain step (cross-entropy, backward, the same AdamW), in each mode: the dense model is as fast
as the library everyone trains with. --cuda-graphs adds a mode compiled with mode="reduce-overhead" (CUDA graphs).
--profile runs 3 more steps of each model, compiled (eager without --compile), under torch.profiler: per step the wall
time, the time the device was busy (its kernels on CUDA; on the CPU its operators' own time), that time by kind
(grouped GEMM, GEMM, attention, inductor's fused kernels, other), and in the JSON the 12 costliest kernels: a MoE's
ratio to the dense model split into the kernels that cost more and the time the device waited on the host.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters as dynamo_counters  # private, but where dynamo counts the graphs it compiles

from mobile_moe.models.costs import costs
from mobile_moe.models.moe import compile_model, expert_dispatch
from mobile_moe.models.registry import create_model, list_models
from mobile_moe.training import engine, recipes
from mobile_moe.training.optimizer import adamw
from mobile_moe.training.routing import TrainingForward

# mode -> torch.compile's options (None: eager)
MODES = {"eager": None, "compiled": {}, "cudagraphs": engine.CUDA_GRAPHED}
DENSE = "vit"
ANCHOR = "deit_tiny_patch16_224"  # timm's, the dense model everyone trains


def parse_args(argv: list[str] | None = None, **defaults) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--models",
        nargs="+",
        default=list_models(),
        choices=list_models(),
        metavar="MODEL",
        help=f"registry models (default: all; {DENSE} is always measured, as the baseline)",
    )
    parser.add_argument("--size", default="12x192")
    parser.add_argument("--patch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--experts", type=int, default=10, help="E of every MoE (L = 2 MoE layers, WideNet: all)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model and mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model (compilation happens here)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--compile", action="store_true", help="also measure every model compiled")
    parser.add_argument("--cuda-graphs", action="store_true", help='also compiled with mode="reduce-overhead" (CUDA)')
    parser.add_argument("--anchor", action="store_true", help=f"also timm's {ANCHOR} against vit in a plain step")
    parser.add_argument("--profile", action="store_true", help="also where each model's step time goes, by kind")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of markdown")
    parser.set_defaults(**defaults)
    return parser.parse_args(argv)


def model_at_size(name: str, args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    fields = {"patch_size": args.patch, "image_size": args.image_size, "num_classes": args.num_classes}
    if name != DENSE:
        fields["num_experts"] = args.experts
        fields |= {} if name == "widenet" else {"moe_layers": 2}
    return create_model(name, args.size, **fields)


def build(name: str, args: argparse.Namespace, device: torch.device, mode: str) -> engine.Optimisation:
    """The model at the benchmark's size, training's AdamW, a flat schedule, its training forward (as `mode` runs
    it)."""
    model = model_at_size(name, args).to(device).train()
    optimizer = adamw(model, lr=1e-4, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    forward = TrainingForward(model)
    options = MODES[mode]
    step_module = forward if options is None else compile_model(forward, **options)
    return engine.Optimisation(step_module, model, optimizer, schedule, cuda_graphs=mode == "cudagraphs")


def spread_clusters(opt: engine.Optimisation, images: torch.Tensor) -> None:
    """A Hard MoE's k-means router, seeded with E images' own features (as k-means++ would), so the batch spreads
    over its experts as a fitted one does; other models are left as they are."""
    model = opt.model
    if model.config.routing != "cluster":
        return
    with torch.no_grad():
        router = model.router
        seeds = router.project(model.image_features(images[: model.config.num_experts]))
        router.set_clusters(router.pca_mean, router.pca_components, seeds)


def training_steps(runs: dict[str, engine.Optimisation], batch, device) -> dict[str, Callable[[], None]]:
    """Training's step of each model (forward_loss, then update) on the batch, as a call."""
    cfg = recipes.deit().replace(epochs=1, amp=device.type == "cuda")
    images, targets, super_targets = batch

    def training_step(opt: engine.Optimisation) -> Callable[[], None]:
        supers = super_targets if opt.model.config.routing == "image" else None

        def step() -> None:
            opt.begin_step()  # the gradients released; CUDA graphs: a new step (models take turns)
            _, terms = engine.forward_loss(opt.step_module, images, targets, supers, cfg)
            engine.update(opt, terms.total, cfg.grad_clip)

        return step

    return {name: training_step(opt) for name, opt in runs.items()}


def take_turns(steps: dict[str, Callable[[], None]], args, device, mode: str) -> dict[str, dict]:
    """Each model's step in turn (vit, mobile-vmoe, ..., vit, ...), args.warmup untimed rounds then args.steps timed
    -> {name: {"seconds": [...], "first_step_s", "timed_compiles", "graph_breaks"}}."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    stats = {name: {"seconds": [], "timed_compiles": 0, "graph_breaks": 0} for name in steps}
    for step in range(args.warmup + args.steps):
        for name, run in steps.items():
            graphs, breaks = dynamo_counters["stats"]["unique_graphs"], sum(dynamo_counters["graph_break"].values())
            sync()
            start = time.perf_counter()
            run()
            sync()
            record(stats[name], step, args.warmup, time.perf_counter() - start, graphs)
            stats[name]["graph_breaks"] += sum(dynamo_counters["graph_break"].values()) - breaks
    return stats


# A kernel's or an operator's kind, by the first of these its lowercased name contains: CUTLASS's grouped kernels and
# aten::_grouped_mm name their groups; cuBLAS's and CUTLASS's dense ones say gemm, xmma or nvjet; SDPA's say flash,
# fmha or sdpa (cuDNN's); inductor's own kernels start with triton_ on CUDA, and on the CPU run inside the compiled
# graph's own call.
KINDS = {
    "grouped GEMM": ("group",),
    "GEMM": ("gemm", "xmma", "nvjet", "aten::mm", "aten::addmm", "aten::bmm"),
    "attention": ("flash", "fmha", "sdpa", "attention"),
    "inductor's fused": ("triton_", "compiledfxgraph"),
}
PROFILED_STEPS = 3


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KINDS.items() if any(mark in lowered for mark in marks)), "other")


def profile_models(steps: dict[str, Callable[[], None]], device: torch.device, mode: str) -> dict[str, dict]:
    """PROFILED_STEPS more steps of each model under torch.profiler -> {name: {"wall_ms", "busy_ms" (per step: the
    device's kernels on CUDA, the operators' own CPU time on the CPU), "by_kind": {kind: ms per step}, "top": [[name,
    ms per step], ...]}}: whether the step waits on the host (busy well under wall) and which kernels cost more."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    profiles = {}
    for name, run in steps.items():
        with profile(activities=activities) as profiler:
            sync()
            start = time.perf_counter()
            for _ in range(PROFILED_STEPS):
                run()
            sync()
            wall = time.perf_counter() - start
        spent = {}
        for event in profiler.key_averages():
            if event.device_type == (DeviceType.CUDA if on_cuda else DeviceType.CPU):
                own_us = event.self_device_time_total if on_cuda else event.self_cpu_time_total
                spent[event.key] = own_us / 1e3 / PROFILED_STEPS
        by_kind = {}
        for key, ms in spent.items():
            kind = kind_of(key)
            by_kind[kind] = by_kind.get(kind, 0.0) + ms
        top = sorted(spent.items(), key=lambda item: -item[1])[:12]
        profiles[name] = {"wall_ms": wall * 1e3 / PROFILED_STEPS, "busy_ms": sum(spent.values()), "by_kind": by_kind,
                          "top": [[key[:120], ms] for key, ms in top]}  # fmt: skip
    return profiles


def record(stats: dict, step: int, warmup: int, seconds: float, graphs_before: int) -> None:
    """One step's time: the first warm-up step's apart (compiling happens there), the timed steps' in a list."""
    if step == 0:
        stats["first_step_s"] = seconds
    if step >= warmup:
        stats["seconds"].append(seconds)
        stats["timed_compiles"] += dynamo_counters["stats"]["unique_graphs"] - graphs_before


class Logits(torch.nn.Module):
    """A model's logits, whether it returns them (timm) or a ModelOutput (ours)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        output = self.model(images)
        return getattr(output, "logits", output)


def anchor_models(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    """timm's ANCHOR at the benchmark's size (its width, depth, heads, patch, image size, pooling) and our vit."""
    import timm  # only for the anchor

    ours = model_at_size(DENSE, args)
    cfg = ours.config
    torch.manual_seed(0)
    theirs = timm.create_model(ANCHOR, num_classes=args.num_classes, img_size=args.image_size, patch_size=args.patch,
                               embed_dim=cfg.width, depth=cfg.depth, num_heads=cfg.num_heads,
                               global_pool="token" if cfg.pool == "cls" else "avg")  # fmt: skip
    return {f"timm {ANCHOR}": theirs, DENSE: ours}


def time_anchor(mode: str, args, device, batch) -> dict[str, dict]:
    """A plain step (cross-entropy, backward, training's AdamW) of each anchor model, taking turns -> {name: stats}."""
    images, targets, _ = batch
    labels = targets.argmax(-1)

    def plain_step(model: torch.nn.Module) -> Callable[[], None]:
        model = model.to(device).train()
        options = MODES[mode]
        forward = Logits(model) if options is None else compile_model(Logits(model), **options)
        optimizer = adamw(model, lr=1e-4, weight_decay=0.05)
        # as our models' steps begin (engine.Optimisation.begin_step): the gradients released, and with CUDA graphs
        # a new step marked, or the tree would take this model's step for the last model's continuation
        opt = engine.Optimisation(forward, model, optimizer, None, cuda_graphs=mode == "cudagraphs")

        def step() -> None:
            opt.begin_step()
            with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                loss = torch.nn.functional.cross_entropy(forward(images).float(), labels)
            loss.backward()
            optimizer.step()

        return step

    return take_turns({name: plain_step(model) for name, model in anchor_models(args).items()}, args, device, mode)


def summary(stats: dict, batch_size: int) -> dict:
    ordered = sorted(stats["seconds"])
    median = statistics.median(ordered)
    return {
        "median_ms": median * 1e3,
        "p90_ms": ordered[math.ceil(0.9 * len(ordered)) - 1] * 1e3,  # nearest rank
        "images_per_s": batch_size / median,
        "timed_compiles": stats["timed_compiles"],
        "graph_breaks": stats["graph_breaks"],
        "first_step_s": stats["first_step_s"],
    }


def modes(args: argparse.Namespace) -> list[str]:
    return ["eager", *(["compiled"] if args.compile else []), *(["cudagraphs"] if args.cuda_graphs else [])]


def profiled_mode(args: argparse.Namespace) -> str:
    """--profile's mode: the compiled one, whose ratio to the dense model the goals bound; eager without --compile."""
    return "compiled" if args.compile else "eager"


def measure(args: argparse.Namespace, device: torch.device) -> tuple[dict, dict, dict[str, str], dict]:
    """-> ({mode: {model: summary}}, the anchor's alike, {mode: why it failed}, profile_models' in the profiled_mode
    where --profile); each mode builds its models afresh from the same seed. A mode that raises is named with its
    error, and the modes before it still report."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator).to(device)
    labels = torch.randint(0, args.num_classes, (args.batch_size,), generator=generator).to(device)
    targets = torch.nn.functional.one_hot(labels, args.num_classes).float()
    super_targets = torch.nn.functional.one_hot(labels % args.experts, args.experts).float()  # planted
    names = [DENSE, *(name for name in args.models if name != DENSE)]
    # The models share code (TrainingForward.forward, the blocks' forwards): dynamo keeps a graph per model under each
    # shared code object, more than its default limit of 8 per code object once every model is measured in one run.
    torch._dynamo.config.recompile_limit = 8 * len(names)
    torch._dynamo.config.accumulated_recompile_limit = 64 * len(names)
    results, anchor, failed, profiles = {}, {}, {}, {}
    for mode in modes(args):
        runs = None  # a failed mode's models (and CUDA graph pools) go before the next mode builds its own
        try:
            runs = {name: build(name, args, device, mode) for name in names}
            for opt in runs.values():
                spread_clusters(opt, images)
            steps = training_steps(runs, (images, targets, super_targets), device)
            stats = take_turns(steps, args, device, mode)
            results[mode] = {name: summary(stats[name], args.batch_size) for name in names}
            if args.profile and mode == profiled_mode(args):
                profiles = profile_models(steps, device, mode)
            del steps
            del runs
            if args.anchor:
                stats = time_anchor(mode, args, device, (images, targets, super_targets))
                anchor[mode] = {name: summary(value, args.batch_size) for name, value in stats.items()}
        except Exception as error:  # noqa: BLE001 - a compiler's failure in one mode, reported, not the whole run's
            if mode == "eager":  # the baseline every ratio divides by
                raise
            failed[mode] = error_line(error)
            print(f"{mode}: failed{'' if mode not in results else ' (in the anchor)'}: {failed[mode]}", file=sys.stderr)
    return results, anchor, failed, profiles


def error_line(error: BaseException) -> str:
    """A failure as one line of a benchmark's results: its type and the first line of its message."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def ratios(results: dict[str, dict[str, dict]], flops: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per model: step time over the dense model's in each mode, that ratio per FLOP (over the FLOPs ratio), and each
    compiled mode over eager."""
    table = {}
    for name in results["eager"]:
        row = {}
        for mode, by in results.items():
            row[f"{mode} / dense {mode}"] = by[name]["median_ms"] / by[DENSE]["median_ms"]
            row[f"{mode} per FLOP"] = row[f"{mode} / dense {mode}"] / (flops[name] / flops[DENSE])
        for mode in results.keys() - {"eager"}:
            row[f"{mode} / eager"] = results[mode][name]["median_ms"] / results["eager"][name]["median_ms"]
        table[name] = row
    return table


def print_markdown(report: dict) -> None:
    print(f"{report['device']}, torch {report['torch']}, {report['setup']}")
    print(f"Mobile V-MoE's and Hard MoE's expert dispatch: {report['expert_dispatch']}\n")
    modes = list(report["variants"])
    header = ["model"] + [f"{mode} ms (p90)" for mode in modes] + list(next(iter(report["ratios"].values())))
    compiled = [mode for mode in modes if mode != "eager"]
    header += [f"{mode} first step s, timed compiles, graph breaks" for mode in compiled]
    print("| " + " | ".join(header) + " |\n|---|" + "---:|" * (len(header) - 1))
    for name, row in report["ratios"].items():
        runs = {mode: report["variants"][mode][name] for mode in modes}
        times = [f"{run['median_ms']:.1f} ({run['p90_ms']:.1f})" for run in runs.values()]
        cells = [name, *times, *(f"{value:.3f}x" for value in row.values())]
        cells += [f"{runs[mode]['first_step_s']:.1f}, {runs[mode]['timed_compiles']}, {runs[mode]['graph_breaks']}"
                  for mode in compiled]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    for mode, by in report.get("anchor", {}).items():
        (timm_name, theirs), ours = next(iter(by.items())), by[DENSE]
        print(f"\nanchor, {mode}, plain step: {timm_name} {theirs['median_ms']:.1f} ms (p90 {theirs['p90_ms']:.1f}), "
              f"vit {ours['median_ms']:.1f} ms (p90 {ours['p90_ms']:.1f}): vit / timm "
              f"{ours['median_ms'] / theirs['median_ms']:.3f}x")  # fmt: skip
    for mode, why in report.get("failed_modes", {}).items():
        print(f"\n{mode}: failed: {why}")
    if "profile" in report:
        print_profile(report["profile"])
    print(
        "\nGoals (GPU, issue 48): mobile-vmoe / dense <= 1.10x eager and <= 1.05x compiled; every MoE per FLOP "
        "<= 1.15 compiled; vit / timm <= 1.00x; compiled / eager < 1 for every model. (CPU: mobile-vmoe / dense "
        "<= 1.03x eager.)"
    )


def print_profile(profile: dict) -> None:
    """Per model, ms per step: wall, busy (the device's kernels, or the CPU's operators), and busy by kind."""
    models = profile["models"]
    kinds = sorted({kind for row in models.values() for kind in row["by_kind"]})
    print(f"\nprofile, {profile['mode']}, {profile['steps']} steps, ms per step (every kernel: the report's JSON):")
    print("| model | wall | busy | " + " | ".join(kinds) + " |\n|---|" + "---:|" * (len(kinds) + 2))
    for name, row in models.items():
        by_kind = (f"{row['by_kind'].get(kind, 0.0):.2f}" for kind in kinds)
        print(f"| {name} | {row['wall_ms']:.2f} | {row['busy_ms']:.2f} | " + " | ".join(by_kind) + " |")


def main(argv: list[str] | None = None, **defaults) -> dict:
    args = parse_args(argv, **defaults)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        sys.exit(2)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.cuda_graphs and device.type != "cuda":
        print("--cuda-graphs: CUDA graphs need --device cuda", file=sys.stderr)
        sys.exit(2)
    results, anchor, failed, profiles = measure(args, device)
    flops = {name: costs(model_at_size(name, args).config).flops for name in results["eager"]}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    precision = "bf16 autocast" if device.type == "cuda" else "fp32"
    setup = (f"{args.size}/{args.patch} @{args.image_size}, {args.num_classes} classes, E={args.experts}, batch "
             f"{args.batch_size}, {precision}, {args.warmup} warm-up + {args.steps} timed steps per model")  # fmt: skip
    report = {"device": where, "torch": torch.__version__, "setup": setup, "variants": results,
              "expert_dispatch": expert_dispatch(device, amp=device.type == "cuda"),
              "ratios": ratios(results, flops), **({"anchor": anchor} if anchor else {}),
              **({"failed_modes": failed} if failed else {})}  # fmt: skip
    if profiles:
        report["profile"] = {"mode": profiled_mode(args), "steps": PROFILED_STEPS, "models": profiles}
    print(json.dumps(report, indent=2)) if args.json else print_markdown(report)
    return report


if __name__ == "__main__":
    main()
