"""Training-step time of Mobile V-MoE over the dense ViT of the same backbone, measured in one run.

    python benchmarks/train_step.py                     # the paper's ViT-Ti/32, E=10, k=1, L=2, batch 64, 224 px
    python benchmarks/train_step.py --size 4x64 --patch 8 --image-size 32 --num-classes 10 --experts 5 --pool mean \
        --batch-size 32                                 # the demo's digits models

Both models see the same batch; each step is forward + router loss + backward + AdamW update. Steps alternate between
the models (dense, MoE, dense, ...) so drift in machine load hits both alike; the ratio compares medians. The goal for
ViT-Ti/32 on CPU is <= 1.10x: grouped dispatch costs k expert runs per image, not E.
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
    parser.add_argument("--patch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--pool", default="cls")
    parser.add_argument("--experts", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    torch.manual_seed(0)
    shape = {
        "patch_size": args.patch,
        "image_size": args.image_size,
        "num_classes": args.num_classes,
        "pool": args.pool,
    }
    models = {
        "vit": create_model("vit", args.size, **shape).to(device).train(),
        "mobile-vmoe": create_model("mobile-vmoe", args.size, num_experts=args.experts, **shape).to(device).train(),
    }
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in models.items()}
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, args.num_classes, (args.batch_size,), device=device)
    super_labels = labels % args.experts  # planted super-classes so the router spreads images over experts
    times: dict[str, list[float]] = {name: [] for name in models}
    for step in range(args.warmup + args.steps):
        for name, model in models.items():
            sync()
            start = time.perf_counter()
            train_step(model, optimizers[name], images, labels, super_labels)
            sync()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)

    dense, moe = (statistics.median(times[name]) for name in models)
    experts_used = len(models["mobile-vmoe"](images).routing.experts.unique())
    print(
        f"{args.size}/{args.patch} @{args.image_size}, batch {args.batch_size}, {device}, "
        f"{torch.get_num_threads()} threads, {args.steps} steps (median)"
    )
    print(f"  dense ViT        {dense * 1e3:8.1f} ms/step  {args.batch_size / dense:7.0f} img/s")
    print(
        f"  Mobile V-MoE     {moe * 1e3:8.1f} ms/step  {args.batch_size / moe:7.0f} img/s"
        f"  (E={args.experts}, k=1, L=2; {experts_used} experts in use)"
    )
    print(f"  ratio MoE/dense  {moe / dense:8.3f}x   (goal for ViT-Ti/32 on CPU: <= 1.10x)")


if __name__ == "__main__":
    main()
