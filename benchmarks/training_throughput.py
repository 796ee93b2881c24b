"""Training throughput (images/s, forward + backward + AdamW step) of the demo's dense ViT vs Mobile V-MoE on CPU.

Interleaves the two models round by round so that machine noise hits both alike; prints medians and the ratio.
    .venv/bin/python benchmarks/training_throughput.py [--rounds 5] [--steps 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mobile_moe.config import make_config
from mobile_moe.registry import build_model
from training.demo import DEMO_MODEL, DEMO_MOE


def step_rate(model, optimizer, images, labels, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        output = model(images)
        loss = F.cross_entropy(output.logits, labels)
        if output.routing is not None:
            loss = loss + 0.3 * F.cross_entropy(output.routing.logits, labels % 5)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return steps * len(images) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    fields = {k: v for k, v in DEMO_MODEL.items() if k != "size"}
    models = {
        "dense": build_model(make_config("vit", DEMO_MODEL["size"], num_classes=10, **fields)),
        "moe": build_model(make_config("mobile-vmoe", DEMO_MODEL["size"], num_classes=10, **fields, **DEMO_MOE)),
    }
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    images = torch.randn(args.batch, 3, fields["image_size"], fields["image_size"])
    labels = torch.randint(0, 10, (args.batch,))
    for name in models:  # warm-up
        step_rate(models[name], optimizers[name], images, labels, 2)
    rates: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name in models:
            rates[name].append(step_rate(models[name], optimizers[name], images, labels, args.steps))
    dense, moe = statistics.median(rates["dense"]), statistics.median(rates["moe"])
    print(f"threads {args.threads}, batch {args.batch}, {DEMO_MODEL}, MoE {DEMO_MOE}")
    print(f"dense ViT     {dense:8.0f} img/s (median of {args.rounds} x {args.steps} steps)")
    print(f"Mobile V-MoE  {moe:8.0f} img/s")
    print(f"MoE / dense   {moe / dense:8.2f}")


if __name__ == "__main__":
    main()
