"""Ctrl-C and SIGTERM under the CLI (mobile_moe/interrupts.py): held until torch's tracing ends, never swallowed."""

from __future__ import annotations

import os
import signal

import pytest

from mobile_moe.atomic import atomic_path
from mobile_moe.interrupts import Terminated, held, stop_signals


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)  # the handler runs at the next bytecode of this (the main) thread


@pytest.mark.parametrize(("signum", "stop"), [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_a_stop_inside_a_held_block_is_raised_at_its_end(signum, stop):
    ran = []
    with stop_signals(), pytest.raises(stop):
        with held():
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


def test_a_second_stop_while_held_raises_at_once():
    ran = []
    with stop_signals(), pytest.raises(KeyboardInterrupt), held():
        _signal_self(signal.SIGINT)
        ran.append("held")
        _signal_self(signal.SIGINT)
        ran.append("not reached")
    assert ran == ["held"]


class _SignalsWhenCollected:
    def __del__(self):
        _signal_self(signal.SIGTERM)  # the handler's Terminated is raised here, and Python only prints it


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed stop, printed
def test_a_stop_swallowed_by_a_del_still_stops_the_write(tmp_path):
    target = tmp_path / "out.txt"
    with stop_signals(), pytest.raises(Terminated):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            _SignalsWhenCollected()  # collected at once: the stop goes to its __del__
    assert list(tmp_path.iterdir()) == []


def test_a_stop_is_raised_once_so_the_clean_up_can_write(tmp_path):
    with stop_signals():
        with pytest.raises(Terminated), held():
            _signal_self(signal.SIGTERM)
        with atomic_path(tmp_path / "after.txt") as tmp:
            tmp.write_text("written as the stop unwinds")
    assert (tmp_path / "after.txt").read_text() == "written as the stop unwinds"


def test_without_stop_signals_a_held_block_changes_nothing():
    ran = []
    with pytest.raises(KeyboardInterrupt), held():  # Python's own SIGINT handler
        _signal_self(signal.SIGINT)
        ran.append("not reached")
    assert ran == []


def test_stop_signals_puts_the_handlers_back():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with stop_signals():
        assert signal.getsignal(signal.SIGINT) != before[0]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
