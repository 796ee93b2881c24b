"""Where the toolkit keeps what it can rebuild: MOBILE_MOE_CACHE, else $XDG_CACHE_HOME/mobile-moe (an absolute one),
else ~/.cache/mobile-moe. The native runner's builds (mobile_moe/library/build.py), the ARM64 wheel
(mobile_moe/device_bench/arm64.py), image folders' checks (mobile_moe/data/image_check.py) and XNNPACK's packed
weights (packed_weights_dir) live under it, each in its own folder."""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path

from mobile_moe.errors import Note, UsageError


def cache_root() -> Path:
    """MOBILE_MOE_CACHE, else $XDG_CACHE_HOME/mobile-moe where XDG_CACHE_HOME is an absolute path (the XDG Base
    Directory Specification: "If an implementation encounters a relative path in any of these variables it should
    consider the path invalid and ignore it"), else ~/.cache/mobile-moe."""
    if os.environ.get("MOBILE_MOE_CACHE"):
        return Path(os.environ["MOBILE_MOE_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path(home()) / ".cache") / "mobile-moe"


def home() -> str:
    """HOME, or the user's home directory from the password database where HOME is unset, empty or relative (a
    relative one would put the cache wherever a command runs): the rule the native runner's default_cache_dir()
    follows too. A user the database does not know (a container's uid) with no HOME is one line, not a KeyError."""
    import pwd

    given = os.environ.get("HOME", "")
    if os.path.isabs(given):
        return given
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        raise UsageError(
            f"no home folder: HOME is {'unset' if not given else 'relative'} and user {os.getuid()} is not in the "
            "password database; set HOME, or MOBILE_MOE_CACHE to a folder for the toolkit's caches"
        ) from None


# XNNPACK takes a packed-weight file's path as a backend option of at most 255 bytes, and the library hands it paths
# this much longer than their folder's (packed_cache.h longest_cache_path: a key, ".xnnpack", staged_files.h's
# longest staged suffix, ".scratch").
MAX_CACHE_PATH = 255


def longest_cache_path(folder: Path) -> int:
    host = socket.gethostname().split(".")[0]
    suffix = f"/{'0' * 32}.xnnpack.tmp-{'9' * 10}-{'f' * 8}@{host}.scratch"
    return len(os.fsencode(str(folder) + suffix))


def unusable_weight_folder(folder: Path) -> str:
    """Why the library cannot keep packed weights in `folder` ("" when it can), by its own checks
    (packed_cache.h unusable_cache_folder), making it where it is missing."""
    longest = longest_cache_path(folder)
    if longest > MAX_CACHE_PATH:
        return (f"its path is too long for XNNPACK's cache path option ({longest} of at most {MAX_CACHE_PATH} "
                "characters with the file name)")  # fmt: skip
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot create it ({error.strerror or error})"
    if not folder.is_dir():
        return "not a directory"
    return "" if os.access(folder, os.W_OK) else "not writable"


def packed_weights_dir() -> Path | None:
    """The native runner's packed-weight cache (mobile_moe/library/libmobile_moe/src/packed_cache.h: one checked file
    per graph, kept under a size limit), shared by every run of this user: MOBILE_MOE_WEIGHT_CACHE, else
    cache_root()/packed-weights. Created on first use. Derived, never chosen, so one that cannot be used (none
    derived, one that cannot be made or written, a path too long for XNNPACK) refuses nothing: None with a Note
    saying why, and runs pack on the heap, as the library does with its default_cache_dir()."""
    try:
        path = Path(os.environ.get("MOBILE_MOE_WEIGHT_CACHE") or cache_root() / "packed-weights")
        why = unusable_weight_folder(path)
    except UsageError as error:
        path, why = None, str(error)
    if not why:
        return path
    where = f"per-user folder {path}: {why}" if path is not None else f"no per-user folder ({why})"
    warnings.warn(f"packed-weight cache off (graphs are packed in memory): {where}", Note, stacklevel=2)
    return None


def free_bytes(folder: Path) -> int | None:
    """Bytes this user may still write on the file system that holds `folder` (or its nearest existing parent);
    None where that cannot be told."""
    for place in (folder, *folder.parents):
        try:
            stats = os.statvfs(place)
        except OSError:
            continue
        return stats.f_bavail * stats.f_frsize
    return None
