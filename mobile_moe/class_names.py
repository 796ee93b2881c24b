"""A file of class names given on the command line (`--class-names`): one name per line, or a JSON list of strings
(a .json file). One reader for every command that takes one (superclass derive, import)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mobile_moe.errors import UsageError


def read_class_names(path: str | os.PathLike) -> list[str]:
    """The names in `path`, or one UsageError line. Never opens a FIFO or device (it could block)."""
    path = str(path)
    if not Path(path).exists():
        raise UsageError(f"--class-names {path} does not exist; give a file with one class name per line")
    if not Path(path).is_file():
        raise UsageError(f"--class-names {path} is not a regular file; give a file with one class name per line")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read --class-names {path}: {error}") from None
    if path.endswith(".json"):
        try:
            names = json.loads(text)
        except RecursionError:
            raise UsageError(f"--class-names {path}: not JSON: nested too deeply") from None
        except ValueError as error:  # JSONDecodeError, or an integer too long to convert
            raise UsageError(f"--class-names {path}: not JSON: {error}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise UsageError(f"--class-names {path}: expected a JSON list of strings")
        return names
    return [line.strip() for line in text.splitlines() if line.strip()]
