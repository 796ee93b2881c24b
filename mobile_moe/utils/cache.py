"""Where the toolkit keeps what it can rebuild: MOBILE_MOE_CACHE, else $XDG_CACHE_HOME/mobile-moe (an absolute one),
else ~/.cache/mobile-moe. The native runner's builds (mobile_moe/library/build.py), the ARM64 wheel
(mobile_moe/device_bench/arm64.py) and image folders' checks (mobile_moe/data/image_check.py) live under it, each in
its own folder. XNNPACK's packed weights go to the folder libmobile_moe decides (its packed-weights folder under the
same root, unless MOBILE_MOE_WEIGHT_CACHE says otherwise): mobile_moe.library.binding.default_weight_cache_dir asks
it."""

from __future__ import annotations

import os
from pathlib import Path

from mobile_moe.errors import UsageError


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
