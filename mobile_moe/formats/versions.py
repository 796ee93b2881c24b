"""Format versions: every file format mobile-moe writes for a user to keep or pass on states its version, and its one
reader accepts exactly that version. A file of another version, or one that states none, is refused in one line that
says what the file is, which version it holds, which one this mobile-moe reads, and what to do. There are no
migrations: a file of another version is made again by the command that makes it.

Each format keeps its version beside its one reader, which calls check_version (docs/formats.md names each format's
version field). A cache is rebuilt, never refused: the image-check cache ignores a file of another version
(states_version), and caches rebuilt on any mismatch state none."""

from __future__ import annotations

import json
from typing import Any

from mobile_moe.errors import UsageError
from mobile_moe.utils.words import shown


def states_version(data: Any, version: int) -> bool:
    """Whether `data` (a file's parsed top level) states format version `version`: an int (true and 1.0 are none)."""
    found = data.get("version") if isinstance(data, dict) else None
    return type(found) is int and found == version


def check_version(data: Any, version: int, *, where: str, what: str, fix: str) -> None:
    """UsageError in one line unless `data` (a file's parsed top level, a dict) states format version `version`
    exactly (an int: true and 1.0 are no version). `where` names the file, `what` is what it is ("a run", "a
    super-class file"), `fix` what makes a file of this version ("train it again into a new --out")."""
    if states_version(data, version):
        return
    found = data.get("version") if isinstance(data, dict) else None
    reads = f"this mobile-moe reads version {version}"
    if found is None:
        held = "of format version 0 (it states none)"
    elif type(found) is not int:
        stated = shown(json.dumps(found), 40)
        raise UsageError(f"{where} states format version {stated}, not an integer; {reads}: {fix}")
    elif found > version:
        held, fix = f"of format version {found} (written by a newer mobile-moe)", f"upgrade mobile-moe, or {fix}"
    else:
        held = f"of format version {found}"
    raise UsageError(f"{where} is {what} {held}; {reads}: {fix}")
