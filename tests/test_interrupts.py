"""Ctrl-C and SIGTERM under the CLI (mobile_moe/utils/interrupts.py): held until torch's tracing ends; one that a
`__del__` swallowed is raised at the next safe point."""

from __future__ import annotations

import contextlib
import importlib
import signal
import subprocess
import sys
import threading
import time

import pytest
from faults import outlives_its_killed_parent, running

from mobile_moe.utils.atomic import atomic_path
from mobile_moe.utils.interrupts import Terminated, held, leave_stops_to_the_main_process, stop_signals


def _signal_self(signum: int) -> None:
    # raise(3) signals this thread; os.kill(getpid()) may land on any of the process's threads (torch's, xdist's), and
    # Python's handler then runs whenever the main thread next checks: after the block meant to see it, sometimes
    signal.raise_signal(signum)


@pytest.mark.parametrize(
    ("signals", "stop"),
    [
        ([signal.SIGTERM], Terminated),
        ([signal.SIGINT], KeyboardInterrupt),
        # torchrun forwards a terminal's Ctrl-C to its workers as SIGTERM: one Ctrl-C, two signals, still held
        ([signal.SIGINT, signal.SIGTERM], Terminated),
    ],
)
def test_a_stop_inside_a_held_block_is_raised_at_its_end(signals, stop):
    ran = []
    with stop_signals(), pytest.raises(stop):
        with held():
            for signum in signals:
                _signal_self(signum)
            ran.append("the rest of the block")
        ran.append("after the block")
    assert ran == ["the rest of the block"]


def test_nested_blocks_raise_at_the_outermost_end():
    ran = []
    with stop_signals(), pytest.raises(Terminated):
        with held():
            with held():
                _signal_self(signal.SIGTERM)
            ran.append("the outer block goes on")
    assert ran == ["the outer block goes on"]


def test_the_same_signal_twice_while_held_raises_at_once():
    ran = []
    with stop_signals(), pytest.raises(KeyboardInterrupt), held():
        _signal_self(signal.SIGINT)
        ran.append("held")
        _signal_self(signal.SIGINT)
        ran.append("not reached")
    assert ran == ["held"]


def test_an_error_in_a_held_block_does_not_hide_the_stop():
    with stop_signals(), pytest.raises(Terminated) as raised, held():
        _signal_self(signal.SIGTERM)
        raise ValueError("the block failed too")
    assert isinstance(raised.value.__context__, ValueError)


class _SignalsWhenCollected:
    def __del__(self):
        _signal_self(signal.SIGTERM)  # the handler's Terminated is raised here, where Python only reports it


def test_a_stop_swallowed_by_a_del_still_stops_the_write(tmp_path):
    target = tmp_path / "out.txt"
    with stop_signals(), pytest.raises(Terminated):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            _SignalsWhenCollected()  # collected at once: the stop goes to its __del__
    assert list(tmp_path.iterdir()) == []


def test_a_stop_swallowed_by_a_del_is_raised_before_a_held_block_runs():
    ran = []
    with stop_signals(), pytest.raises(Terminated):
        _SignalsWhenCollected()
        ran.append("not a safe point")
        with held():
            ran.append("not reached")
    assert ran == ["not a safe point"]


def test_a_stop_swallowed_by_a_del_wins_over_the_error_it_caused():
    """A DataLoader whose old iterator's __del__ took the stop finds its workers, stopped by the same signal, gone."""
    with pytest.raises(Terminated) as stopped, stop_signals():
        _SignalsWhenCollected()
        raise RuntimeError("DataLoader worker (pid(s) 1) exited unexpectedly")
    assert isinstance(stopped.value.__context__, RuntimeError)
    with pytest.raises(RuntimeError), stop_signals():  # no stop pending: the error itself
        raise RuntimeError("a real failure")


def test_a_dataloader_worker_leaves_the_stop_to_the_main_process():
    """A worker the group's stop reached ends with status 0, which torch's SIGCHLD check takes for a worker that
    ended, not one that failed (killed by the signal, it made torch raise in the main process as that stopped)."""
    import multiprocessing

    for signum in (signal.SIGINT, signal.SIGTERM):
        worker = multiprocessing.get_context("fork").Process(target=_stopped_worker, args=(signum,))
        worker.start()
        worker.join(timeout=30)
        assert worker.exitcode == 0


def _stopped_worker(signum: int) -> None:
    leave_stops_to_the_main_process()
    signal.raise_signal(signum)
    time.sleep(30)  # not reached


def test_a_stop_swallowed_by_a_del_is_raised_when_the_command_ends():
    with pytest.raises(Terminated), stop_signals():
        _SignalsWhenCollected()


@pytest.mark.parametrize("raised_by", ["a held block's end", "the handler"])
def test_a_stop_is_raised_once_so_the_clean_up_can_write(tmp_path, raised_by):
    with stop_signals(), pytest.raises(Terminated):
        try:
            with held() if raised_by == "a held block's end" else contextlib.nullcontext():
                _signal_self(signal.SIGTERM)
        finally:
            with atomic_path(tmp_path / "after.txt") as tmp:
                tmp.write_text("written as the stop unwinds")
    assert (tmp_path / "after.txt").read_text() == "written as the stop unwinds"


def test_without_stop_signals_a_held_block_changes_nothing():
    ran = []
    # Python's own SIGINT handler, set here: a shell starts a background job with SIGINT ignored, and Python keeps that
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), held():
            _signal_self(signal.SIGINT)
            ran.append("not reached")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ran == []


@pytest.mark.parametrize(
    "load",
    [
        pytest.param(lambda name: exec(f"import {name}"), id="import statement"),
        pytest.param(importlib.import_module, id="importlib.import_module"),
    ],
)
def test_a_stop_during_an_import_waits_for_the_whole_module(tmp_path, monkeypatch, load):
    """A module interrupted halfway stays half-initialized for whoever imports it next (torch, numpy and timm caught
    their own imports' errors and carried on with one); so the stop is raised once the module is whole."""
    (tmp_path / "signals_halfway.py").write_text(
        "import signal\nsignal.raise_signal(signal.SIGTERM)\nSECOND_HALF = 'ran'\n"
    )
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(sys.modules, "signals_halfway", raising=False)
    with stop_signals(), pytest.raises(Terminated):
        load("signals_halfway")
    assert sys.modules["signals_halfway"].SECOND_HALF == "ran"


def test_stop_signals_puts_the_handlers_back():
    import importlib._bootstrap

    hooks = lambda: (  # noqa: E731
        signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook,
        importlib._bootstrap._find_and_load,
    )  # fmt: skip
    before = hooks()
    with stop_signals():
        during = hooks()
    assert hooks() == before
    assert [now != then for now, then in zip(during, before, strict=True)] == [True] * 4


@pytest.mark.parametrize(
    "signum, status, line", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_a_stop_that_lands_after_the_command_ended_still_ends_the_process_with_its_status(signum, status, line):
    """`mobile-moe` as the process's command (until_exit): once the command has ended (its outputs whole), a Ctrl-C
    or SIGTERM during the interpreter's shutdown ends the process with 130 or 143 and its one line, after what the
    command printed: never status 0 (the stop swallowed), never Python's handler ending it without a word."""
    script = (
        "import os, signal, time\n"
        "from mobile_moe.utils.interrupts import stop_signals\n"
        "with stop_signals(until_exit=True):\n"
        "    print('the command printed this', flush=False)\n"
        f"os.kill(os.getpid(), {int(signum)})\n"
        "time.sleep(5)\n"
        "print('never')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == status
    assert result.stdout == "the command printed this\n" and result.stderr == f"mobile-moe: {line}\n"


def test_a_stop_while_a_child_runs_kills_the_child_and_everything_it_started(tmp_path):
    """run_child: a SIGTERM while a build (cmake, then its compilers) or a runner runs takes the whole process group
    with it; subprocess.run would kill the child alone and leave the grandchildren running."""
    from mobile_moe.utils.interrupts import run_child

    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(grandchild.pid))\n"
        "time.sleep(60)\n"
    )
    main_thread = threading.get_ident()

    def stop_when_started():
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.02)
        signal.pthread_kill(main_thread, signal.SIGTERM)  # the main thread: it waits on the child's pipes

    threading.Thread(target=stop_when_started, daemon=True).start()
    started = time.monotonic()
    with stop_signals(), pytest.raises(Terminated):
        run_child([sys.executable, "-c", script], capture_output=True)
    assert time.monotonic() - started < 30
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and running(grandchild):
        time.sleep(0.05)
    assert not running(grandchild)


@pytest.mark.parametrize("dies_with_parent", [True, False])
def test_a_worker_dies_with_the_bench_that_started_it_even_when_the_bench_is_sigkilled(dies_with_parent, tmp_path):
    """die_with_parent (the runtime workers; the native runner sets the same): a SIGKILLed bench cannot stop its
    worker, so the kernel does. Without it the worker runs on. The bench is killed once the worker says it is set up:
    on a busy machine its imports can take longer than any fixed wait."""
    ready = tmp_path / "ready"
    setup = "from mobile_moe.utils.interrupts import die_with_parent; die_with_parent(); " if dies_with_parent else ""
    worker = [sys.executable, "-c", setup + f"open({str(ready)!r}, 'w').close(); import time; time.sleep(60)"]
    assert outlives_its_killed_parent(worker, ready=ready) != dies_with_parent


def test_a_loader_iterator_the_stop_cut_short_is_not_reported_as_the_command_ends(monkeypatch):
    """A stop that lands while a DataLoader starts its iterator leaves it without `_shutdown`: its __del__ raises
    AttributeError, which Python would print after the stop's line. Quiet once the stop is unwinding (multiprocessing
    exiting, as _raise marks it); the same error before a stop is still reported."""
    import gc
    import multiprocessing.util

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reported.append(unraisable.exc_value))

    def half_built() -> None:
        _MultiProcessingDataLoaderIter.__new__(_MultiProcessingDataLoaderIter)  # __init__ never ran
        gc.collect()

    monkeypatch.setattr(multiprocessing.util, "_exiting", False)  # an earlier test's stop set it for the process
    with stop_signals():
        half_built()
        assert len(reported) == 1 and "_shutdown" in str(reported[0])  # no stop: an error worth seeing
        monkeypatch.setattr(multiprocessing.util, "_exiting", True)
        half_built()
        assert len(reported) == 1
