"""What an expert switch pays to map and unmap its packed weights depends on how the page cache holds the file
(issue 37). The same bytes, mapped, touched once a page and unmapped, with the page cache filled three ways, in ONE
run on this host:

    .venv/bin/python benchmarks/page_cache_folios.py [--dir DIR] [--mb 4.37] [--repeats 101]

- written through a shared mapping, a page at a time: how ExecuTorch's XNNPACK weight cache writes its file
  (backends/xnnpack/runtime/XNNWeightsCache.cpp, reserve_space maps the file and XNNPACK packs into the mapping);
- written with large writes: how the native runner publishes an expert's file (packed_cache.cpp, copy_in_large_writes);
- written as the backend does, dropped from the page cache, then read back through mappings advised MADV_HUGEPAGE,
  one 256 KiB window at a time: how the library's check reads a file that is not in the page cache, as after a reboot
  (packed_cache.cpp, file_xxh64);
- the same, read back with read(2) instead: what the check would leave without the advice.

Printed for each: the medians of mmap, touch and munmap in ms, their sum's ratio to the first way's, and how much of
the touched mapping the kernel mapped with 2 MiB entries (/proc/self/smaps FilePmdMapped). The default size is one
ViT-Ti/32 expert's packed weights (4.37 MB, attention and MLP of two blocks). DIR (default: the user's packed-weight
cache folder, whose filesystem the runner's files live on) gets a temporary folder, removed after. Nothing else may
run on the host meanwhile.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from mobile_moe.library.binding import default_weight_cache_dir

PAGE = mmap.PAGESIZE
CHECK_WINDOW = 256 * 1024  # packed_cache.cpp's kCheckWindow


def written_page_by_page(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, len(data))
    with mmap.mmap(fd, len(data), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapping:
        for at in range(0, len(data), PAGE):
            mapping[at : at + PAGE] = data[at : at + PAGE]
        mapping.flush()
    os.close(fd)


def written_in_large_writes(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def read_back_advised(path: Path, data: bytes) -> None:
    """As the check reads a file: window by window, each window its own mapping advised MADV_HUGEPAGE."""
    written_page_by_page(path, data)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # clean pages, which the advice below may drop
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    for at in range(0, len(data), CHECK_WINDOW):
        with mmap.mmap(fd, min(CHECK_WINDOW, len(data) - at), mmap.MAP_PRIVATE, mmap.PROT_READ, offset=at) as window:
            window.madvise(mmap.MADV_HUGEPAGE)
            touch(window)
    os.close(fd)


def read_back_in_pieces(path: Path, data: bytes) -> None:
    """The alternative the check does not take: read(2) in 64 KiB pieces (the kernel's readahead picks the folios)."""
    written_page_by_page(path, data)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    while os.read(fd, 64 * 1024):
        pass
    os.close(fd)


def touch(mapping: mmap.mmap) -> None:
    pages = np.frombuffer(mapping, dtype=np.uint8)
    int(pages[::PAGE].sum())  # one byte of every page, read in C
    del pages  # the buffer export must go before the mapping can close


def pmd_mapped_kb(path: Path) -> int:
    """FilePmdMapped of this process's mapping of `path`, in kB."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith(str(path)))
    for line in lines[start + 1 :]:
        if line.startswith("FilePmdMapped:"):
            return int(line.split()[1])
    return 0


def map_touch_unmap(path: Path, size: int) -> tuple[float, float, float, int]:
    """Seconds to mmap, touch and munmap the whole file, and its FilePmdMapped (kB) while mapped."""
    fd = os.open(path, os.O_RDONLY)
    start = time.perf_counter()
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    mapped = time.perf_counter()
    touch(mapping)
    touched = time.perf_counter()
    pmd_kb = pmd_mapped_kb(path)
    unmap_start = time.perf_counter()
    mapping.close()
    unmapped = time.perf_counter()
    os.close(fd)
    return mapped - start, touched - mapped, unmapped - unmap_start, pmd_kb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="default: the user's packed-weight cache folder")
    parser.add_argument("--mb", type=float, default=4.37, help="file size in MB (default 4.37)")
    parser.add_argument("--repeats", type=int, default=101)
    args = parser.parse_args()
    parent = args.dir or default_weight_cache_dir() or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    data = np.random.default_rng(0).integers(0, 256, int(args.mb * 1e6), dtype=np.uint8).tobytes()
    ways = {
        "written through a mapping, a page at a time (the backend)": written_page_by_page,
        "written in large writes (the runner's publication)": written_in_large_writes,
        "read back through MADV_HUGEPAGE mappings of 256 KiB windows (the library's check)": read_back_advised,
        "read back with read(2) in 64 KiB pieces": read_back_in_pieces,
    }
    with tempfile.TemporaryDirectory(dir=parent, prefix="page-cache-folios-") as folder:
        paths = {way: Path(folder) / f"way{i}.bin" for i, way in enumerate(ways)}
        for way, make in ways.items():
            make(paths[way], data)
        times: dict[str, list[tuple[float, float, float, int]]] = {way: [] for way in ways}
        for _ in range(args.repeats):  # interleaved, so drift on the host falls on every way alike
            for way in ways:
                times[way].append(map_touch_unmap(paths[way], len(data)))
    print(f"{len(data) / 1e6:.2f} MB in {parent}, {args.repeats} repeats, medians in ms\n")
    print("| page cache filled | mmap | touch | munmap | total | / page by page | FilePmdMapped kB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    baseline = None
    for way, rows in times.items():
        parts = [statistics.median(row[i] for row in rows) * 1e3 for i in range(3)]
        total = statistics.median(sum(row[:3]) for row in rows) * 1e3
        baseline = baseline or total
        print(f"| {way} | {parts[0]:.3f} | {parts[1]:.3f} | {parts[2]:.3f} | {total:.3f} | {total / baseline:.3f} "
              f"| {rows[-1][3]} |")  # fmt: skip


if __name__ == "__main__":
    main()
