"""Where the toolkit keeps what it can rebuild: ~/.cache/mobile-moe, or MOBILE_MOE_CACHE. The native runner's builds
(device_bench/native_build.py), the ARM64 wheel (device_bench/arm64.py) and image folders' checks
(training/image_check.py) live under it, each in its own folder."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MOBILE_MOE_CACHE", Path.home() / ".cache" / "mobile-moe"))
