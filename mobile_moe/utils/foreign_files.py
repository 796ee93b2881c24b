"""The one reader of a file we did not write this run (a store's parts, a bundle's manifest, a confusion or
super-class file, a run's config.json and metrics.jsonl, a bench's results.json): a file someone hands us may be a
FIFO (open() waits for a writer forever), a link to an endless device (read() grows the process until the kernel
kills it) or a sparse giant. So it is opened without blocking, must be a regular file, and is read with a bound its
format sets; anything else is one line naming the file.

    data = read_foreign(path, limit=MAX_MANIFEST_BYTES, what="manifest")
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mobile_moe.errors import UsageError

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}  # fmt: skip


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_foreign(path: str | os.PathLike, *, what: str) -> int:
    """A file descriptor of the regular file `path`, opened without waiting (O_NONBLOCK: a FIFO does not block the
    open); UsageError naming `what` and the path for anything else. The caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise UsageError(f"cannot read {what} {path}: {error.strerror or error}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UsageError(f"{what} {path} is {_kind(mode)}, not a file; give the file itself")
    os.set_blocking(fd, True)
    return fd


def read_foreign(path: str | os.PathLike, *, limit: int, what: str) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them (the largest file of its format we write);
    UsageError naming `what` for a file of another kind, a larger one, or one that cannot be read."""
    fd = open_foreign(path, what=what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UsageError(f"{what} {path} is {size} bytes, more than a {what} can be ({limit}); is it the right "
                             "file?")  # fmt: skip
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):  # + 1: a file that grew past its size shows
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise UsageError(f"{what} {path} grew past {limit} bytes while it was read; is something writing it?")
        return b"".join(chunks)
    except OSError as error:
        raise UsageError(f"cannot read {what} {path}: {error.strerror or error}") from None
    finally:
        os.close(fd)


def read_foreign_text(path: str | os.PathLike, *, limit: int, what: str) -> str:
    """read_foreign, decoded as UTF-8 (UsageError for other bytes)."""
    try:
        return read_foreign(path, limit=limit, what=what).decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(
            f"cannot read {what} {Path(path)}: not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None
