"""Where a training epoch's steady window goes: the time from the end of step W (SteadyWindow's opening, after the
loader's first round) to the epoch's end, split so that its parts add up to it.

The main thread's wall time, step by step:

- `waiting_s`: blocked for the next batch (on the loader, or on the thread that prepares batches ahead);
- `preparing_s`: preparing that batch on the main thread (off CUDA: its transfer, crops and mixing, in turn);
- `step_cpu_s`: the step's launches (forward, loss, backward, clipping, optimizer, schedule) on this thread's CPU;
- `step_blocked_s`: the step's wall time off this thread's CPU: waiting for the interpreter lock (the threads that
  prepare batches and pin memory hold it in turns) or for the device (a synchronising call);
- `loop_s`: the loop's own work after the step (the running sums, the steady window, the progress line, the reads);
- `other_s`: the rest of the window (the stop check, the loop itself): what the parts above leave out.

Beside it, over the same window: `gpu_busy_s` (CUDA: each step's span between events recorded on the step's stream
before and after its launches; an upper bound on the kernels' time, since a gap the host leaves inside a step counts),
the thread that prepares batches ahead (`ahead_busy_s` preparing, `ahead_blocked_s` waiting for room in its queue:
data/ahead.py), and the CPU time of torch's pin-memory thread (`pin_memory_cpu_s`, from /proc on Linux). The parts are
perf_counter and thread_time readings, a few microseconds a step: always on, in every epoch's metrics row.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

MAIN_PARTS = ("waiting_s", "preparing_s", "step_cpu_s", "step_blocked_s", "loop_s")


def thread_cpu_seconds(native_id: int) -> float | None:
    """A thread's CPU time (user + system) so far, from /proc; None where it cannot be read (not Linux, gone)."""
    try:
        fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15
    except (OSError, ValueError, IndexError):
        return None


def pin_memory_thread() -> threading.Thread | None:
    """torch's pin-memory thread of a DataLoader iterating now (torch/utils/data/dataloader.py starts it with
    _utils.pin_memory._pin_memory_loop as its target), or None."""
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)
        if target is not None and getattr(target, "__name__", "") == "_pin_memory_loop":
            return thread
    return None


class EpochAttribution:
    """The steady window's parts, read step by step (see the module)."""

    def __init__(self, device: torch.device, first: int):
        self.first, self.cuda = first, device.type == "cuda"  # the step whose end opens the window
        self.parts = dict.fromkeys(MAIN_PARTS, 0.0)
        self.opened: float | None = None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._ahead_at_open: tuple[float, float] | None = None
        self._pin_at_open: tuple[threading.Thread, float] | None = None

    @contextlib.contextmanager
    def next_batch(self, batches) -> Iterator[None]:
        """Taking the next batch of `batches` (data/ahead.py BatchesAhead): the part it blocked (its `waited`) and
        the part it prepared on this thread."""
        if self.opened is None:
            yield
            return
        before, wall = batches.waited, time.perf_counter()
        yield
        wall, waited = time.perf_counter() - wall, batches.waited - before
        self.parts["waiting_s"] += waited
        self.parts["preparing_s"] += max(wall - waited, 0.0)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The step's launches: their wall time, on this thread's CPU or off it, and on CUDA their span on the
        step's stream."""
        if self.opened is None:
            yield
            return
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.cuda else None
        if events is not None:
            events[0].record()
        wall, cpu = time.perf_counter(), time.thread_time()
        yield
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        if events is not None:
            events[1].record()
            self._events.append(events)
        self.parts["step_cpu_s"] += min(cpu, wall)
        self.parts["step_blocked_s"] += max(wall - cpu, 0.0)

    @contextlib.contextmanager
    def loop(self) -> Iterator[None]:
        """The loop's own work after a step."""
        if self.opened is None:
            yield
            return
        wall = time.perf_counter()
        yield
        self.parts["loop_s"] += time.perf_counter() - wall

    def stepped(self, step: int, batches) -> None:
        """After step `step` of `batches` (data/ahead.py BatchesAhead): the window opens at the end of step
        `first`, where the thread preparing batches ahead has spent its first (busy, blocked) seconds."""
        if step == self.first:
            self.opened = time.perf_counter()
            self._ahead_at_open = batches.ahead_times
            thread = pin_memory_thread()
            start = thread_cpu_seconds(thread.native_id) if thread is not None and thread.native_id else None
            self._pin_at_open = (thread, start) if start is not None else None

    def row(self, batches) -> dict[str, float | None] | None:
        """The window's parts, `batches`' thread's among them (None where the window never opened: an epoch of no
        more steps than workers)."""
        if self.opened is None:
            return None
        window = time.perf_counter() - self.opened
        parts = {name: round(value, 6) for name, value in self.parts.items()}
        gpu = None
        if self._events:
            self._events[-1][1].synchronize()
            gpu = sum(start.elapsed_time(end) for start, end in self._events) / 1e3
        pin = None
        if self._pin_at_open is not None:
            thread, start = self._pin_at_open
            now = thread_cpu_seconds(thread.native_id) if thread.native_id else None
            pin = None if now is None else now - start
        ahead, at_open = batches.ahead_times, self._ahead_at_open
        busy, blocked = (None, None) if ahead is None or at_open is None else (ahead[0] - at_open[0],
                                                                               ahead[1] - at_open[1])  # fmt: skip
        return {"window_s": round(window, 6), **parts, "other_s": round(window - sum(self.parts.values()), 6),
                "gpu_busy_s": gpu, "ahead_busy_s": busy, "ahead_blocked_s": blocked,
                "pin_memory_cpu_s": pin}  # fmt: skip
