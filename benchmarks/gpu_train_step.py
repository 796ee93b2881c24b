"""Training throughput on a GPU: train_step.py with a GPU's defaults (every registry model against the dense ViT,
eager and compiled, bf16 autocast).

    python benchmarks/gpu_train_step.py                  # DeiT-Ti/16 @224, 1000 classes, E=10, batch 256, 30 steps
    python benchmarks/gpu_train_step.py --models vit mobile-vmoe --json

Any train_step.py flag overrides these defaults (--help lists them).
"""

from __future__ import annotations

# Python puts this script's directory first on sys.path, so train_step.py is the one benchmark, not a copy.
from train_step import main

GPU_DEFAULTS = {"device": "cuda", "size": "deit-ti", "patch": 16, "batch_size": 256, "steps": 30, "warmup": 5,
                "compile": True}  # fmt: skip

if __name__ == "__main__":
    main(**GPU_DEFAULTS)
