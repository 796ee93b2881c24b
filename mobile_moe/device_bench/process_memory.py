"""This process's memory as the OS reports it (Linux/Android /proc); None where the OS does not say."""

from __future__ import annotations

from pathlib import Path


def _kb_fields(path: str, *keys: str) -> dict[str, int | None]:
    """`Key:   1234 kB` lines of ONE read of a /proc file, in bytes; None for a key (or a file) that is absent."""
    found: dict[str, int | None] = dict.fromkeys(keys)
    try:
        text = Path(path).read_text()
    except OSError:
        return found
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in found:
            found[key] = int(value.split()[0]) * 1024
    return found


def memory_now() -> dict:
    """rss_bytes (VmRSS), peak_rss_bytes (VmHWM, the high-water mark) and pss_bytes (smaps_rollup Pss). VmRSS and
    VmHWM come from one read: RSS reclaimed between two reads could leave the second's VmHWM below the first's VmRSS."""
    status = _kb_fields("/proc/self/status", "VmRSS", "VmHWM")
    return {
        "rss_bytes": status["VmRSS"],
        "peak_rss_bytes": status["VmHWM"],
        "pss_bytes": _kb_fields("/proc/self/smaps_rollup", "Pss")["Pss"],
    }
