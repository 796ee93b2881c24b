"""Why 4-bit experts are not faster than int8 on this CPU: one ViT-Ti expert MLP (50 tokens, 192 -> 768 -> 192, the
ViT-Ti/32 expert graph of the per-block layout) lowered to XNNPACK as int8 (static, per channel), 8da4w at several
weight-scale group sizes (32 is `--quantize 8da4w`'s) and 4-bit per channel, all timed in one run:

    python benchmarks/expert_mlp_4bit_kernels.py [--calls 300] [--rounds 7]

ExecuTorch's Python runtime on 1 thread (its threadpool reset to 1, as the native runner's bench runs); each round
times every variant in turn (`--calls` calls after 50 untimed), and the table gives the median round and the range.
Ratios are against int8, measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from mobile_moe.export.executorch_backend import lower, quantize_pt2e
from mobile_moe.models.vit import Mlp

TOKENS, WIDTH, HIDDEN = 50, 192, 768


def four_bit(mlp: nn.Module, granularity) -> nn.Module:
    """torchao's 8da4w config (int8 dynamic activations, int4 weights) at `granularity`; --quantize 8da4w is
    PerGroup(32)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_

    quantized = copy.deepcopy(mlp)
    quantize_(quantized, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=granularity))
    return quantized


def variants(mlp: nn.Module, example: torch.Tensor) -> dict[str, tuple[nn.Module, bool]]:
    """name -> (module, lowered with our rewrites only: 8da4w graphs keep torchao's quantized linears)."""
    from torchao.quantization.granularity import PerAxis, PerGroup

    calibration = [(torch.randn(1, TOKENS, WIDTH),) for _ in range(8)]
    return {
        "fp32": (mlp, False),
        "int8": (quantize_pt2e(mlp, (example,), calibration), False),
        **{f"8da4w, group {size}": (four_bit(mlp, PerGroup(size)), True) for size in (32, 64, WIDTH)},
        "4-bit per channel": (four_bit(mlp, PerAxis(0)), True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime

    torch.manual_seed(0)
    mlp, example = Mlp(WIDTH, HIDDEN).eval(), torch.randn(1, TOKENS, WIDTH)
    portable_lib._unsafe_reset_threadpool(1)
    runtime = Runtime.get()
    buffers, methods, sizes = [], {}, {}
    for name, (module, rewrites_only) in variants(mlp, example).items():
        program, _ = lower(module, (example,), rewrites_only=rewrites_only)
        buffers.append(program.buffer)  # the loaded program reads this memory: it must outlive the method
        methods[name] = runtime.load_program(buffers[-1]).load_method("forward")
        sizes[name] = len(buffers[-1])
    rounds: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, method in methods.items():
            for _ in range(50):
                method.execute([example])
            start = time.perf_counter()
            for _ in range(args.calls):
                method.execute([example])
            rounds[name].append((time.perf_counter() - start) / args.calls * 1e6)
    base = statistics.median(rounds["int8"])
    print("\n| weights | program KB | us per call, median round (range) | / int8 |\n|---|---:|---:|---:|")
    for name, times in rounds.items():
        p50, spread = statistics.median(times), f"{min(times):.1f}-{max(times):.1f}"
        print(f"| {name} | {sizes[name] / 1024:.0f} | {p50:.1f} ({spread}) | {p50 / base:.3f} |")


if __name__ == "__main__":
    main()
