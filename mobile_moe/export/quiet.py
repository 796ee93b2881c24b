"""Third-party noise, silenced at its source, so a successful command prints only its own output.

- torch's pytree module logs a deprecation warning (KernelPreference registered as a constant) when ExecuTorch's
  Python package is imported; coremltools logs that this torch and scikit-learn are untested and that its
  macOS-only proxies are absent: loggers, so their levels are set.
- ExecuTorch's C++ runtime writes to file descriptor 2 (its cpuinfo probe prints five lines at the first XNNPACK
  load on machines without ARM identification files) and, through its Python bindings, to sys.stderr (a program
  that fails verification logs why): no logging to configure. `native_stderr_captured` holds both during such
  calls; what the library wrote is passed on only with MOBILE_MOE_DEBUG=1 (the failure itself reaches the user as
  our one-line error).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

NOISY_LOGGERS = ("torch.utils._pytree", "coremltools")


def quiet_third_party_loggers() -> None:
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


_capture_file = None  # one per process: opening a file per call would cost more than the calls it wraps


def _emptied_capture_file():
    global _capture_file
    if _capture_file is None:
        _capture_file = tempfile.TemporaryFile()
    _capture_file.seek(0)
    _capture_file.truncate()
    return _capture_file


@contextlib.contextmanager
def native_stderr_captured() -> Iterator[None]:
    """Capture what native code writes to fd 2 or sys.stderr during the block; replay it only with
    MOBILE_MOE_DEBUG=1. Cheap enough (a few system calls) to wrap every inference call."""
    sys.stderr.flush()
    saved = os.dup(2)
    python_side = io.StringIO()
    capture = _emptied_capture_file()
    os.dup2(capture.fileno(), 2)
    try:
        with contextlib.redirect_stderr(python_side):
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        if os.environ.get("MOBILE_MOE_DEBUG") == "1":
            capture.seek(0)
            sys.stderr.write(capture.read().decode(errors="replace") + python_side.getvalue())
