"""Training-step time of Mobile V-MoE over the dense ViT of the same backbone, measured in one run.

    python benchmarks/train_step.py [--size 12x192] [--batch-size 64] [--steps 10] [--device cpu]

Both models see the same batch; each step is forward + router loss + backward + AdamW update. Steps alternate between
the models (dense, MoE, dense, ...) so drift in machine load hits both alike; the printed ratio compares medians.
The goal for ViT-Ti/32 (E=10, k=1, L=2) on CPU is <= 1.10x: grouped dispatch costs k expert runs per image, not E.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mobile_moe.registry import create_model


def train_step(model, optimizer, images, labels, super_labels) -> None:
    out = model(images)
    loss = F.cross_entropy(out.logits, labels)
    if out.routing is not None:
        loss = loss + 0.3 * F.cross_entropy(out.routing.logits, super_labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="12x192")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    torch.manual_seed(0)
    models = {name: create_model(name, args.size).to(device).train() for name in ("vit", "mobile-vmoe")}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in models.items()}
    images = torch.randn(args.batch_size, 3, 224, 224, device=device)
    labels = torch.randint(0, 1000, (args.batch_size,), device=device)
    super_labels = labels % 10  # ten planted super-classes so the router spreads images over experts
    times: dict[str, list[float]] = {name: [] for name in models}
    for step in range(args.warmup + args.steps):
        for name, model in models.items():
            sync()
            start = time.perf_counter()
            train_step(model, optimizers[name], images, labels, super_labels)
            sync()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)

    dense, moe = (statistics.median(times[name]) for name in ("vit", "mobile-vmoe"))
    experts_used = len(models["mobile-vmoe"](images).routing.experts.unique())
    print(f"{args.size}/32, batch {args.batch_size}, {device}, {torch.get_num_threads()} threads, {args.steps} steps")
    print(f"  dense ViT        {dense * 1e3:8.1f} ms/step (median)")
    print(f"  Mobile V-MoE     {moe * 1e3:8.1f} ms/step (median; E=10, k=1, L=2; {experts_used} experts in use)")
    print(f"  ratio MoE/dense  {moe / dense:8.3f}x   (goal <= 1.10x)")


if __name__ == "__main__":
    main()
