"""Format versions: every file format mobile-moe writes states its version, and its one reader accepts exactly that
version. A file of another version, or one that states none (written before mobile-moe versioned its files), is
refused in one line that says what the file is, which version it holds, which one this mobile-moe reads, and what to
do. There are no migrations: a file of another version is made again by the command that makes it.

Each format keeps its version beside its one reader, which calls check_version (docs/formats.md names each format's
version field). A cache is rebuilt, never refused: the image-check cache ignores a file of another version.
"""

from __future__ import annotations

from typing import Any

from mobile_moe.errors import UsageError
from mobile_moe.utils.words import shown


def check_version(data: Any, version: int, *, where: str, what: str, fix: str) -> None:
    """UsageError in one line unless `data` (a file's parsed top level, a dict) states format version `version`
    exactly (an int: true and 1.0 are no version). `where` names the file, `what` is what it is ("a run", "a
    super-class file"), `fix` what makes a file of this version ("train it again into a new --out")."""
    found = data.get("version") if isinstance(data, dict) else None
    if type(found) is int and found == version:
        return
    reads = f"this mobile-moe reads version {version}"
    if found is None:
        held = "of format version 0 (it states none: written before mobile-moe versioned its files)"
    elif type(found) is not int:
        raise UsageError(f"{where} states format version {shown(repr(found), 40)}, not a number; {reads}: {fix}")
    elif found > version:
        held, fix = f"of format version {found} (written by a newer mobile-moe)", f"upgrade mobile-moe, or {fix}"
    else:
        held = f"of format version {found}"
    raise UsageError(f"{where} is {what} {held}; {reads}: {fix}")
