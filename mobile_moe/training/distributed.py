"""Devices and DDP, through torchrun's environment variables only (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

`torchrun --nproc_per_node N -m mobile_moe train ...` runs N copies of the same entry point: gloo on CPU, nccl on
CUDA. Without those variables training is a single process. Only rank 0 writes metrics and checkpoints.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Subset

from mobile_moe.errors import UsageError, exception_chain
from mobile_moe.utils.devices import resolve_device
from mobile_moe.utils.words import shown


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
    """Join the process group torchrun describes (if any) and pick this process's device. Variables torchrun would
    not have set are refused in one line (UsageError) before anything is joined or written."""
    world_size = _torchrun_integer("WORLD_SIZE", 1, "the number of processes, >= 1", smallest=1)
    rank = env_rank()
    local_rank = _torchrun_integer("LOCAL_RANK", 0, "this process's index on its machine, >= 0")
    if rank >= world_size:
        size, unset = (
            (f"WORLD_SIZE={world_size}", "WORLD_SIZE and RANK") if _set("WORLD_SIZE") else ("WORLD_SIZE unset", "RANK")
        )
        raise _refusal(f"RANK={rank} with {size}: torchrun sets 0 <= RANK < WORLD_SIZE", unset)
    if world_size > 1:
        # What init_process_group's env:// rendezvous reads besides WORLD_SIZE (torch/distributed/rendezvous.py).
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK") if not _set(name)]
        if missing:
            names = f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'}"
            problem = f"WORLD_SIZE={world_size} but {names} not set, which init_process_group's env:// rendezvous reads"
            raise _refusal(problem, "WORLD_SIZE")
        _torchrun_integer(
            "MASTER_PORT", 0, "rank 0's TCP port, 1 to 65535", smallest=1, largest=65535, unset="WORLD_SIZE"
        )
    device = resolve_device(device_choice, local_rank)
    if device.type == "cuda" and local_rank >= (count := torch.cuda.device_count()):
        devices = f"{count} CUDA device{'s' if count != 1 else ''}"
        problem = f"LOCAL_RANK={local_rank} but torch sees {devices}: torchrun sets LOCAL_RANK < --nproc_per_node"
        raise _refusal(f"{problem}, one process per device", "LOCAL_RANK")
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Placement(rank, world_size, device)


def env_rank() -> int:
    """This process's rank as torchrun sets RANK: 0 when unset or empty, else its digits (the one reading of it, for
    setup and for run_dir.run_lock, which only rank 0 takes); anything else is refused in one line."""
    return _torchrun_integer("RANK", 0, "this process's index, 0 <= RANK < WORLD_SIZE")


LAUNCH = "launch with torchrun (torchrun --nproc_per_node N -m mobile_moe train ...), which sets these variables"


def _set(name: str) -> bool:
    """Whether environment variable `name` holds a value: torch's rendezvous takes an empty one for unset too."""
    return bool(os.environ.get(name))


def _torchrun_integer(
    name: str, default: int, meaning: str, smallest: int = 0, largest: int | None = None, unset: str | None = None
) -> int:
    """Environment variable `name` as torchrun sets it (`meaning`): decimal digits, from `smallest` to `largest`;
    `default` when unset or empty. Anything else is refused in one line, which says to unset `unset` (else `name`)
    for one process."""
    if not _set(name):
        return default
    text = os.environ[name]
    digits = text.strip()
    value = int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 18 else None
    if value is None or value < smallest or (largest is not None and value > largest):
        raise _refusal(f"{name}={shown(repr(text), 40)} is not what torchrun sets: {name} is {meaning}", unset or name)
    return value


def _refusal(problem: str, unset: str) -> UsageError:
    """The one line a torchrun variable's refusal is: what is wrong, then torchrun or `unset` (names) to fix it."""
    return UsageError(f"{problem}; {LAUNCH}, or unset {unset} to train in one process")


@contextmanager
def process_group(device_choice: str) -> Iterator[Placement]:
    """setup(device_choice)'s placement for a run, its process group destroyed when the run ends, after the run's
    frames have let go of its DDP module. One still alive then holds its Reducer, which pybind frees holding the GIL
    (a plain shared_ptr class, torch/csrc/distributed/c10d/init.cpp), and a Reducer holding the group's last reference
    runs ~ProcessGroupGloo there, which joins the group's threads while one of them waits for the GIL to free a
    finished work's tensors (TensorImpl::decref_pyobject; both stacks read with py-spy): a run that had finished and
    never ended. Two gloo processes on a busy 2-core machine, torch 2.11: 3 runs in 12 hung so, none in 20 with this
    order. Run the run's body in a function of its own, so that its frame ends first; a failure's frames are cleared
    here (a debugger's post-mortem sees no locals of a distributed run)."""
    placement = setup(device_choice)
    try:
        yield placement
    except BaseException as error:
        for raised in exception_chain(error):  # a KeyboardInterrupt caught and re-raised, a failure raised from another
            traceback.clear_frames(raised.__traceback__)
        raise
    finally:
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
