"""How a sweep launches its runs (`reproduce --launcher`): the launchers and a Slurm job's options. Torch-free, so
`mobile-moe reproduce --help` starts at once; mobile_moe/evidence/sweep.py launches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LAUNCHERS = ("local", "submitit")


@dataclass
class SlurmOptions:
    gpus_per_cell: int = 0  # 0: CPU jobs; N: one node, N tasks (one DDP rank per GPU)
    partition: str | None = None
    timeout_min: int = 3 * 24 * 60
    cpus_per_task: int = 8  # a training process and its DataLoader workers
    extra: dict[str, Any] = field(default_factory=dict)  # any other AutoExecutor parameter, e.g. slurm_mem_gb
