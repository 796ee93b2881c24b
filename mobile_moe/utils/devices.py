"""The one reading of `--device auto|cpu|cuda`, for every command that runs a model (train, evaluate, superclass
derive, reproduce): a typo or CUDA that is not there is one line, never a silent fallback. Also what a process has
of its devices: its usable cores, its memory share, its own CUDA streams (process_stream)."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from mobile_moe.errors import UsageError

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(choice: str, local_rank: int = 0) -> torch.device:
    """auto -> cuda if torch sees one, else cpu; cuda -> cuda:`local_rank` (a DDP process's own GPU)."""
    import torch  # here, not at the top: the CLIs import DEVICES for their flags, and `--help` stays torch-free

    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is visible to torch; use --device cpu (or auto)")
        return torch.device("cuda", local_rank)
    if choice == "cpu":
        return torch.device("cpu")
    raise UsageError(f"device {choice!r}: choose {', '.join(DEVICES[:-1])} or {DEVICES[-1]}")


_STREAMS: dict[tuple[str, int], torch.cuda.Stream] = {}
_STREAMS_LOCK = threading.Lock()


def process_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
    """A CUDA stream of its own for `purpose` on `device`, the same one for the whole process: the caching allocator
    keeps a stream's freed blocks for that stream's allocations, so a stream made per call or epoch would strand
    the blocks it cached (each epoch's batches allocated afresh). Thread-safe: batches are prepared on a side thread."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STREAMS_LOCK:
        if (purpose, index) not in _STREAMS:
            _STREAMS[purpose, index] = torch.cuda.Stream(torch.device("cuda", index))
        return _STREAMS[purpose, index]


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one, as on Linux; else all of them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


MAX_MEMORY_SHARE = 0.25  # what one thing a command reads or makes may take of this machine's memory
MAX_MEMORY_SHARE_WORDS = "a quarter"  # MAX_MEMORY_SHARE as a refusal says it


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit() -> int:
    """The bytes one input or argument may ask for (MAX_MEMORY_SHARE of the machine): the one bound of that rule, for
    bench's --images, the IDX files' and .npy files' headers and synthetic data; asked for more, they refuse in one
    line before allocating (over_memory_limit says by how much)."""
    return int(MAX_MEMORY_SHARE * machine_memory())


def over_memory_limit(need_bytes: int) -> str | None:
    """None when `need_bytes` fits memory_limit(); else how a refusal says it ("12.3 GiB, more than a quarter of this
    machine's 23.5 GiB")."""
    if need_bytes <= memory_limit():
        return None
    return (
        f"{need_bytes / 2**30:.1f} GiB, more than {MAX_MEMORY_SHARE_WORDS} of this machine's "
        f"{machine_memory() / 2**30:.1f} GiB"
    )
