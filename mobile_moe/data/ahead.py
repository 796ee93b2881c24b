"""Training batches prepared ahead of the step: on CUDA by a thread of its own, on a CUDA stream of its own.

Preparing a batch on the GPU (nvJPEG decoding, the batched augmentation) costs the host more time than launching a
compiled step, and torchvision's nvJPEG call waits on events and copies from pageable memory as it goes. Done on the
step's own thread and stream, every such wait also waits for the step queued before it, so the GPU runs the step and
then idles while the host prepares the next batch: on one H200 the device pipeline fed a compiled DeiT-Ti step at
0.42 of its rate from a packed store (benchmarks/input_pipeline.results.md). Here a thread prepares the next
`depth` batches on a side stream while the main thread launches steps; each batch's tensors are handed over with an
event the step's stream waits for (no host sync), and `record_stream` keeps the allocator from reusing their memory
before the step is done with them (torch.cuda.Stream's documented hand-over).

The draws depend only on the step's index (batch_augment.StepKey), not on which thread prepared the batch or when,
so the batches are the same as preparing each one in turn; off CUDA they are prepared in turn, on the caller's
thread, where a second thread would only compete with the step for the same cores.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from mobile_moe.utils.devices import process_stream

_DONE = object()  # the loader is exhausted


class BatchesAhead:
    """Iterate `prepare(step, loader_batch)` over `loader` in step order; on CUDA, `depth` batches ahead in a thread.

    `waited` is the time the caller spent blocked for its next batch: on the loader (prepared in turn) or on the
    thread (ahead). Use it as a context manager: leaving stops the thread, however the loop ended."""

    def __init__(
        self,
        loader: Iterable,
        prepare: Callable[[int, Any], tuple],
        device: torch.device,
        *,
        depth: int = 2,
        in_thread: bool | None = None,
    ):
        """`in_thread`: prepare in a thread (None: on CUDA only; off CUDA the thread has no stream of its own)."""
        self._cuda = device.type == "cuda"
        if self._cuda and device.index is None:  # "cuda": the caller's current device, which the thread must use too
            device = torch.device("cuda", torch.cuda.current_device())
        self.prepare, self.device, self.waited = prepare, device, 0.0
        self.ahead_busy = self.ahead_blocked = 0.0  # the thread's seconds preparing, and waiting for room
        self._batches = enumerate(loader)
        self._thread, self._ended = None, False
        if self._cuda if in_thread is None else in_thread:
            self._ready: queue.Queue = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._prepare_ahead, name="batches-ahead", daemon=True)
            self._thread.start()

    def __iter__(self) -> Iterator[tuple]:
        return self

    def __next__(self) -> tuple:
        asked = time.perf_counter()
        if self._thread is None:
            step, loader_batch = next(self._batches)
            self.waited += time.perf_counter() - asked
            return self.prepare(step, loader_batch)
        if self._ended:
            raise StopIteration
        item = self._ready.get()
        self.waited += time.perf_counter() - asked
        if item is _DONE or isinstance(item, BaseException):
            self._ended = True  # the thread has nothing more to give
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        tensors, ready = item
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            for tensor in tensors:
                if tensor is not None:
                    tensor.record_stream(stream)
        return tensors

    @property
    def ahead_times(self) -> tuple[float, float] | None:
        """The thread's (preparing, waiting for room) seconds so far; None where batches are prepared in turn."""
        return None if self._thread is None else (self.ahead_busy, self.ahead_blocked)

    def _prepare_ahead(self) -> None:
        try:
            side = None
            if self._cuda:
                torch.cuda.set_device(self.device)
                side = process_stream(self.device, "batches ahead")  # one for every epoch's thread
            for step, loader_batch in self._batches:
                started = time.perf_counter()
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    tensors = self.prepare(step, loader_batch)
                    ready = torch.cuda.Event() if side is not None else None
                    if ready is not None:
                        ready.record(side)
                prepared = time.perf_counter()
                self.ahead_busy += prepared - started
                handed = self._hand_over((tensors, ready))
                self.ahead_blocked += time.perf_counter() - prepared
                if not handed:
                    return
            self._hand_over(_DONE)
        except BaseException as error:  # the caller raises it, as if it had prepared the batch itself
            self._hand_over(error)

    def _hand_over(self, item) -> bool:
        """Put `item` in the queue unless the caller has left; -> whether it was put."""
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._ready.put(item, timeout=0.1)
                return True
        return False

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def __enter__(self) -> BatchesAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
