"""Ctrl-C and SIGTERM as a clean stop: the one owner of how the CLI stops.

Python raises a signal's exception wherever the main thread happens to be. Two places turn that into something worse
than a stop:
- inside torch's tracing (torch.export, torch.compile, lowering), where Python runs under C++ guards that restore the
  dispatch-mode stack as they unwind: one of them throws, and the process aborts ("trying to set the current
  FakeTensorMode, but one already exists", c10/core/impl/TorchDispatchModeTLS.cpp `set_mode`), leaving its
  temporary files behind;
- inside a `__del__` (torch's StorageWeakRef has one), where Python prints the exception and carries on: the stop is
  lost and the command finishes as if never asked to stop.

So under `stop_signals()` (the CLI's main) a stop that arrives inside `held()` waits for the block's end, and a
stop is remembered, so that `raise_if_stopped()` (atomic writes call it before they publish) raises one that a
`__del__` swallowed. A second stop while held raises at once: the user insisted. Outside `stop_signals()` (a library
caller, a notebook) nothing changes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so the clean-up of atomic writes runs as it does for Ctrl-C."""


_STOPS = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: Terminated}


@dataclass
class _StopState:
    """Python runs signal handlers in the main thread only, so this is the main thread's state."""

    installed: bool = False  # inside stop_signals()
    held: int = 0  # depth of held() blocks
    # The stop that arrived, kept until raise_if_stopped raises it: a __del__ may have swallowed the handler's raise.
    stop: KeyboardInterrupt | None = None

    def reset(self, *, installed: bool) -> None:
        self.installed, self.held, self.stop = installed, 0, None


_state = _StopState()


def _on_stop(signum, frame) -> None:
    insisted = _state.stop is not None and _state.held > 0
    _state.stop = _STOPS[signum]()
    if _state.held == 0 or insisted:
        raise _state.stop


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt and SIGTERM raises Terminated, both deferred by `held()`; restored on exit."""
    previous = {signum: signal.signal(signum, _on_stop) for signum in _STOPS}
    _state.reset(installed=True)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _state.reset(installed=False)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A stop that arrives in this block (torch tracing: see the module's docstring) is raised at its end."""
    if not _state.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.held += 1
    try:
        yield
    finally:
        _state.held -= 1
    if _state.held == 0:
        raise_if_stopped()


def raise_if_stopped() -> None:
    """Raise the stop that arrived and was not raised here yet, if any: a safe point (before publishing a file) for
    a stop that was held or that a `__del__` swallowed."""
    stop = _state.stop
    if stop is not None and threading.current_thread() is threading.main_thread():
        _state.stop = None  # raised once: a clean-up that writes as the stop unwinds it is not stopped again
        raise stop
