"""This process's memory as the OS reports it (Linux/Android /proc); None where the OS does not say."""

from __future__ import annotations

from pathlib import Path


def _kb_field(path: str, key: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_now() -> dict:
    """rss_bytes (VmRSS), peak_rss_bytes (VmHWM, the high-water mark) and pss_bytes (smaps_rollup Pss)."""
    return {
        "rss_bytes": _kb_field("/proc/self/status", "VmRSS"),
        "peak_rss_bytes": _kb_field("/proc/self/status", "VmHWM"),
        "pss_bytes": _kb_field("/proc/self/smaps_rollup", "Pss"),
    }
