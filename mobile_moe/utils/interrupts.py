"""Ctrl-C and SIGTERM as a clean stop: the one owner of how the CLI stops.

Python raises a signal's exception wherever the main thread happens to be. Three places turn that into something worse
than a stop:
- inside an import: the module stays half-initialized, and libraries that catch errors around their own imports carry
  on with it (numpy's `__getattr__` then recursed until RecursionError), swallow the stop (the command went on and
  exited 0), or run the signal's Python handler under a C++ static initializer, which cannot unwind it (torch's
  autograd module: "terminate called after throwing an instance of 'pybind11::error_already_set'", status -6);
- inside torch's tracing (torch.export, torch.compile, lowering), where Python runs under C++ guards that restore the
  dispatch-mode stack as they unwind: one of them throws, and the process aborts ("trying to set the current
  FakeTensorMode, but one already exists", c10/core/impl/TorchDispatchModeTLS.cpp `set_mode`), leaving its
  temporary files behind;
- inside a `__del__` or a weakref callback (torch's StorageWeakRef, WeakValueDictionary), where Python hands the
  exception to sys.unraisablehook, which prints it, and carries on: the stop is lost.

So under `stop_signals()` (the CLI's main):
- loading a module is held (below): a Ctrl-C during torch's import waits the rest of that import, a second or two
  (a second Ctrl-C raises at once, as in any held block, half-import and all: the user insisted);
- a stop that arrives inside `held()` is pending until the outermost held block ends, and raised there (even if the
  block raised something else: the stop wins, with that error as its context);
- a stop that an unraisable hook received is pending again, raised at the next safe point: `raise_if_stopped()`, which
  atomic writes call before they publish, a held block's start or end, or the end of `stop_signals()`, where it also
  takes the place of an error leaving the block (one the stop caused: its context);
- the same signal twice while held raises at once: the user insisted. (torchrun forwards a terminal's Ctrl-C as
  SIGTERM, so one Ctrl-C can bring both signals: that is not insisting.)
Outside `stop_signals()` (a library caller, a notebook) nothing changes.
"""

from __future__ import annotations

import contextlib
import errno
import importlib._bootstrap
import multiprocessing.util
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so the clean-up of atomic writes runs as it does for Ctrl-C."""


_STOPS = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: Terminated}
# The one line a stopped command ends with, by signal (app.cli prints it for a stop raised in the command).
STOPPED_LINES = {signal.SIGINT: "mobile-moe: interrupted", signal.SIGTERM: "mobile-moe: terminated"}


@dataclass
class _StopState:
    """Python runs signal handlers in the main thread only, so this is the main thread's state."""

    installed: bool = False  # inside stop_signals()
    held: int = 0  # depth of held() blocks
    stop: KeyboardInterrupt | None = None  # pending: held, or swallowed by a __del__; raised once

    def reset(self, *, installed: bool) -> None:
        self.installed, self.held, self.stop = installed, 0, None


_state = _StopState()


def _on_stop(signum, frame) -> None:
    stop = _STOPS[signum]()
    insisted = type(_state.stop) is type(stop)
    if _state.held == 0 or insisted:
        _state.stop = None
        _raise(stop)
    _state.stop = stop


def _stopped_after_the_command(signum, frame) -> None:
    """A stop during the interpreter's shutdown: what was printed goes out, then the stop's line and status."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError):
        os.write(2, f"{STOPPED_LINES[signum]}\n".encode())
    os._exit(128 + signum)


def _raise(stop: KeyboardInterrupt) -> NoReturn:
    """Raise the stop. The command ends from here, as at interpreter exit, and is told so: a DataLoader's queues,
    closed as the stop unwinds through it, have feeder threads that then meet a pipe closed under them, which
    multiprocessing reports as a traceback after the stop's line unless the process is exiting
    (multiprocessing/queues.py `Queue._feed`, util.is_exiting: the flag its own exit handler sets)."""
    multiprocessing.util._exiting = True
    raise stop


def _catching_swallowed_stops(previous_hook):
    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):  # our stop, raised inside a __del__: pending again
            _state.stop = unraisable.exc_value
        elif not _closed_as_the_stop_unwound(unraisable):
            previous_hook(unraisable)

    return hook


def _closed_as_the_stop_unwound(unraisable) -> bool:
    """Teardown the stop cut short, while the command ends (see _raise): a multiprocessing pipe end whose descriptor
    a DataLoader's teardown closed already (multiprocessing keeps quiet about its pipes at exit), or a DataLoader
    iterator whose __init__ the stop interrupted before it set `_shutdown`, which its __del__ reads
    (torch/utils/data/dataloader.py, _MultiProcessingDataLoaderIter.__init__, line 1136 in torch 2.14.1)."""
    if not multiprocessing.util.is_exiting():
        return False
    where, error = getattr(unraisable.object, "__qualname__", ""), unraisable.exc_value
    closing_a_pipe = where == "_ConnectionBase.__del__" and getattr(error, "errno", None) == errno.EBADF
    half_started = where == "_MultiProcessingDataLoaderIter.__del__" and isinstance(error, AttributeError)
    return closing_a_pipe or half_started


def _held_loads(load):
    """importlib's `_find_and_load`, held. Every load of a module not yet in sys.modules goes through it: the
    interpreter's import statement calls it on importlib._bootstrap (Python/import.c, import_find_and_load) and
    importlib.import_module calls it from `_gcd_import` (Lib/importlib/_bootstrap.py:1204, Python 3.11.7). A module
    already loaded never reaches it, so this costs nothing after start-up."""

    def held_load(name, import_):
        with held():
            return load(name, import_)

    return held_load


@contextlib.contextmanager
def stop_signals(*, until_exit: bool = False) -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt and SIGTERM raises Terminated, deferred by `held()`; restored on exit. A stop
    still pending when the block ends normally is raised there. Nested, only the outermost one does anything.

    until_exit (the process's own command): on exit a stop ends the process at once, with its one line and status 130
    or 143: the command has ended and its outputs are whole, and what is left (app.cli._end_process: threads joined,
    atexit's functions) is no reason to swallow it into status 0 (a bench signalled after writing its report went on
    to exit 0 under the old SIG_IGN)."""
    if _state.installed:
        yield
        return
    previous = {signum: signal.signal(signum, _on_stop) for signum in _STOPS}
    previous_hook, sys.unraisablehook = sys.unraisablehook, _catching_swallowed_stops(sys.unraisablehook)
    previous_load = importlib._bootstrap._find_and_load
    importlib._bootstrap._find_and_load = _held_loads(previous_load)
    _state.reset(installed=True)
    try:
        yield
        raise_if_stopped()
    except Exception:
        # An error a pending stop caused gives way to it (the error its context): a DataLoader whose old iterator's
        # __del__ swallowed the stop finds its workers, stopped by the same signal, gone ("exited unexpectedly").
        raise_if_stopped()
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, _stopped_after_the_command if until_exit else handler)
        if not until_exit:  # the process ends: its pipes' teardown at exit stays as quiet as during the command
            sys.unraisablehook = previous_hook
        importlib._bootstrap._find_and_load = previous_load
        _state.reset(installed=False)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A stop that arrives in this block (torch tracing: see the module's docstring) is raised at the end of the
    outermost held block; one already pending is raised before the block starts."""
    if not _state.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    raise_if_stopped()
    _state.held += 1
    try:
        yield
    finally:
        _state.held -= 1
        raise_if_stopped()


def raise_if_stopped() -> None:
    """Raise the pending stop, if any and outside any held block: a safe point (before publishing a file) for a stop
    that was held or that a `__del__` swallowed. It is raised once: a clean-up that writes as it unwinds is not
    stopped again."""
    stop = _state.stop
    if stop is not None and _state.held == 0 and threading.current_thread() is threading.main_thread():
        _state.stop = None
        _raise(stop)


def leave_stops_to_the_main_process(_worker_id: int = 0) -> None:
    """A DataLoader's worker_init_fn: the Ctrl-C or SIGTERM that a terminal or `kill -- -PGID` sends to the whole
    process group ends the worker with status 0, the main process being the one to stop the run. Killed by the signal,
    a worker made torch raise in the main process as that stopped (torch/utils/data/_utils/signal_handling.py:
    "DataLoader worker (pid ...) is killed by signal", printed from the loader's `__del__`): torch's SIGCHLD check
    reports a worker that a signal killed or that exited with a status other than 0."""
    for signum in _STOPS:
        signal.signal(signum, lambda *_: os._exit(0))


def run_child(command: Sequence[str], *, capture_output: bool = False, **popen: Any) -> subprocess.CompletedProcess:
    """subprocess.run for the programs the toolkit starts (native runners, runtime workers, builds, qemu), which stop
    with it: the child leads a process group of its own, and when this process stops while it waits (Ctrl-C, SIGTERM,
    any exception) the whole group is killed and reaped, the compilers a build started included. (subprocess.run
    kills the child alone: a SIGTERM during a runner build left cmake's compilers running.)"""
    if capture_output:
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with subprocess.Popen(command, process_group=0, **popen) as process:
        try:
            stdout, stderr = process.communicate()
        except BaseException:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the process that started it dies (Linux's PR_SET_PDEATHSIG, as the
    native runner sets it): a runtime worker whose bench was SIGKILLed, and so could not stop it, stops too. Elsewhere
    it does nothing."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1  # linux/prctl.h
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
