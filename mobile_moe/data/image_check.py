"""Every file of an image folder decoded once before the work starts, and every bad one reported at once.

ImageFolder decodes lazily, so a truncated PNG would kill a run in whichever epoch first draws it, and a text file
named photo.png in val/ would surface only when that split is read. `check_images` decodes each file with the one
decoder (mobile_moe.data.image_files.read_image), on every usable core, with a progress bar on a terminal for large
folders, and raises ONE UsageError naming the bad files (the first few, and how many in all).

A file that decoded is remembered by (path, size, mtime) in MOBILE_MOE_CACHE/image-checks/<hash of the folder>.json,
so the next run on the same folder only stats it. That file is ours and rebuilt when it is anything but what we wrote
(`{"version": 1, "good": {relative path: [size, mtime_ns]}}`; docs/formats.md); one that cannot be written costs
the next run the decoding again, never the run itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mobile_moe.data.image_files import UnreadableImage, read_image
from mobile_moe.errors import UsageError
from mobile_moe.formats.versions import states_version
from mobile_moe.utils.atomic import write_text_atomic
from mobile_moe.utils.cache import cache_root
from mobile_moe.utils.devices import usable_cores

CACHE_VERSION = 1
SHOWN = 3  # bad files named in the one line; the count says how many more
PROGRESS_FROM = 2000  # files: a bar on a terminal from this many unchecked files


def cache_file(folder: Path) -> Path:
    digest = hashlib.sha256(os.fsencode(folder.resolve())).hexdigest()[:32]
    return cache_root() / "image-checks" / f"{digest}.json"


def _stamp(path: Path) -> list[int] | None:
    try:
        status = path.stat()
    except OSError:
        return None  # gone or unreadable: read_image says which
    return [status.st_size, status.st_mtime_ns]


def read_verdicts(cache: Path) -> dict[str, list[int]]:
    """The files known to decode, {relative path: [size, mtime_ns]}; {} for a cache that is missing, not ours, or of
    another format version than CACHE_VERSION (the integer: true is none), which is rebuilt, never refused."""
    try:
        record = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    good = record.get("good") if states_version(record, CACHE_VERSION) else None
    if not isinstance(good, dict):
        return {}
    return {
        name: stamp
        for name, stamp in good.items()
        if isinstance(stamp, list) and len(stamp) == 2 and all(type(v) is int for v in stamp)
    }


def _problem(path: str) -> str | None:
    try:
        read_image(path)
    except UnreadableImage as error:
        return str(error)
    return None


def check_images(folder: Path, paths: list[str], what: str) -> None:
    """Decode every file of `paths` (inside `folder`) not already known to decode; UsageError naming the bad ones."""
    cache = cache_file(folder)
    known = read_verdicts(cache)
    stamps = {path: _stamp(Path(path)) for path in paths}
    relative = {path: os.path.relpath(path, folder) for path in paths}
    unchecked = [path for path in paths if stamps[path] is None or known.get(relative[path]) != stamps[path]]
    problems = _decode_all(unchecked, what)
    good = {relative[path]: stamps[path] for path in paths if path not in problems and stamps[path] is not None}
    if good != known:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(cache, json.dumps({"version": CACHE_VERSION, "good": good}))
        except (UsageError, OSError):
            pass  # a cache we cannot write only costs the next run this check again
    if problems:
        shown = "; ".join(problems[path] for path in sorted(problems)[:SHOWN])
        more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
        raise UsageError(
            f"{what}: {len(problems)} of {len(paths)} image files cannot be read: {shown}{more}; remove or replace "
            "them before training"
        )


def _decode_all(paths: list[str], what: str) -> dict[str, str]:
    """{path: why it cannot be read}, decoding on every usable core (PIL releases the GIL while it decodes)."""
    from tqdm import tqdm

    bar = len(paths) >= PROGRESS_FROM and sys.stderr.isatty()
    with ThreadPoolExecutor(max_workers=usable_cores()) as pool:
        verdicts = tqdm(pool.map(_problem, paths), total=len(paths), desc=f"checking {what}", disable=not bar)
        return {path: problem for path, problem in zip(paths, verdicts, strict=True) if problem is not None}
