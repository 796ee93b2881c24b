"""Where the toolkit keeps what it can rebuild: MOBILE_MOE_CACHE, else $XDG_CACHE_HOME/mobile-moe (an absolute one),
else ~/.cache/mobile-moe. The native runner's builds (mobile_moe/library/build.py), the ARM64 wheel
(mobile_moe/device_bench/arm64.py), image folders' checks (mobile_moe/data/image_check.py) and XNNPACK's packed
weights (packed_weights_dir) live under it, each in its own folder."""

from __future__ import annotations

import os
from pathlib import Path


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
    follows too."""
    import pwd

    given = os.environ.get("HOME", "")
    return given if os.path.isabs(given) else pwd.getpwuid(os.getuid()).pw_dir


def packed_weights_dir() -> Path | None:
    """The native runner's packed-weight cache (mobile_moe/library/libmobile_moe/src/packed_cache.h: one checked file
    per graph, kept under a size limit), shared by every run of this user: MOBILE_MOE_WEIGHT_CACHE, else
    cache_root()/packed-weights. Created on first use; None when it cannot be (a read-only home): runs then pack on the
    heap, as the runner does."""
    path = Path(os.environ.get("MOBILE_MOE_WEIGHT_CACHE") or cache_root() / "packed-weights")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path if path.is_dir() and os.access(path, os.W_OK) else None
