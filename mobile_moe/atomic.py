"""Atomic writes: build at a temporary path beside the target, rename into place only when complete.

Every package writes its outputs through these, so an interrupted or failed command never leaves a half-written file
or directory where a finished one is expected.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path (file, or an empty directory if `directory`) that replaces `target` on success.

    On an exception the temporary path is removed and `target` is left as it was. An existing target directory is
    replaced as a whole.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}.tmp-"
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, dir=target.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        if directory and target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(target: str | os.PathLike, text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text)
