"""Devices and DDP, through torchrun's environment variables only (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

`torchrun --nproc_per_node N -m mobile_moe train ...` runs N copies of the same entry point: gloo on CPU, nccl on
CUDA. Without those variables training is a single process. Only rank 0 writes metrics and checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Subset

from mobile_moe.devices import resolve_device


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup(device_choice: str) -> Placement:
    """Join the process group torchrun describes (if any) and pick this process's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_choice, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Placement(rank, world_size, device)


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard(dataset: Dataset, placement: Placement) -> Dataset:
    """Every world_size-th item from this rank: disjoint shards covering the split exactly (no padding), for
    evaluation whose counts are all-reduced afterwards."""
    if not placement.distributed:
        return dataset
    return Subset(dataset, range(placement.rank, len(dataset), placement.world_size))


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """All-reduce mean of a tensor, element-wise (identity when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        value = value.detach().clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value
