"""Batches prepared ahead in a thread (data/ahead.py): the same batches in the same order as prepared in turn, the
loader's and the preparation's errors raised in the caller, and a loop left early stops the thread."""

from __future__ import annotations

import threading

import pytest
import torch

from mobile_moe.data.ahead import BatchesAhead

CPU = torch.device("cpu")


def prepare(step: int, loader_batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(step)  # drawn from the step, as batch_augment's StepKey
    return loader_batch * 2 + torch.rand(loader_batch.shape, generator=generator), None


def threads_named(name: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == name]


@pytest.mark.parametrize("in_thread", [False, True])
def test_the_batches_are_the_ones_prepared_in_turn_in_step_order(in_thread):
    loader = [torch.full((4, 3), float(step)) for step in range(7)]
    with BatchesAhead(loader, prepare, CPU, in_thread=in_thread, depth=2) as batches:
        got = list(batches)
    want = [prepare(step, batch) for step, batch in enumerate(loader)]
    assert len(got) == len(want)
    for (images, nothing), (expected, _) in zip(got, want, strict=True):
        assert nothing is None and torch.equal(images, expected)
    assert not threads_named("batches-ahead")


def test_off_cuda_batches_are_prepared_in_turn_on_the_callers_thread():
    callers = []
    with BatchesAhead(range(3), lambda step, batch: callers.append(threading.current_thread()) or (batch,), CPU) as it:
        assert [batch for (batch,) in it] == [0, 1, 2]
    assert callers == [threading.main_thread()] * 3


@pytest.mark.parametrize("fails_in", ["loader", "prepare"])
def test_an_error_in_the_thread_is_raised_in_the_caller_after_the_batches_before_it(fails_in):
    def loader():
        yield from range(3)
        if fails_in == "loader":
            raise OSError("disk gone")
        yield 3

    def failing(step, batch):
        if fails_in == "prepare" and step == 3:
            raise ValueError("bad batch")
        return (batch,)

    got = []
    with pytest.raises(OSError if fails_in == "loader" else ValueError), BatchesAhead(
        loader(), failing, CPU, in_thread=True
    ) as batches:
        for (batch,) in batches:
            got.append(batch)
    assert got == [0, 1, 2]
    with pytest.raises(StopIteration):  # once ended, it stays ended (never waits on a thread that has gone)
        next(batches)


def test_a_loop_left_early_stops_the_thread_before_the_loader_is_drained():
    drawn = []

    def loader():
        for step in range(1000):
            drawn.append(step)
            yield step

    with BatchesAhead(loader(), lambda step, batch: (batch,), CPU, in_thread=True, depth=2) as batches:
        assert next(batches) == (0,)
    assert not threads_named("batches-ahead")
    assert len(drawn) <= 5  # the one taken, `depth` queued, one being prepared, one drawn as it stopped


def test_waited_counts_the_time_blocked_on_the_next_batch():
    release = threading.Event()

    def slow_loader():
        release.wait(timeout=5)
        yield 0

    batches = BatchesAhead(slow_loader(), lambda step, batch: (batch,), CPU, in_thread=True)
    threading.Timer(0.2, release.set).start()
    with batches:
        assert next(batches) == (0,)
    assert 0.15 < batches.waited < 5
