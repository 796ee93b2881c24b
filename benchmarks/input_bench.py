"""What the input path's benchmarks share: the images they write (ImageNet-sized photographs of a harsh mix of kinds, or
ImageNet's mix, in an image folder, and the folder packed into a store), and how they report (a median with its
spread, an epoch's parts as shares, a figure that failed as its error line). The benchmarks:

    input_host_cost.py   the host's CPU time per image of each input path (per image, device-fed, batched on the CPU)
    input_crop.py        --input-pipeline crop on this CPU: one worker, the graph, epoch 2 against per image
    input_accuracy.py    test top-1 per input pipeline and seed (does the batched path train as well?)
    input_gpu_epoch.py   a real epoch on a GPU over the step alone, where its time goes, and the loader's margin
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image

from mobile_moe.data import store
from mobile_moe.data.datasets import open_data
from mobile_moe.utils.devices import usable_cores

# Each kind's share of the folder's images: this benchmark's harsh mix, and one like ImageNet's (about 98% baseline
# JPEG; a few thousand grayscale and 22 CMYK files in 1.28M)
MIXES = {
    "harsh": {"baseline": 0.80, "progressive": 0.08, "cmyk": 0.04, "grayscale": 0.04, "png": 0.04},
    "imagenet": {"baseline": 0.98, "progressive": 0.01, "grayscale": 0.01},
}
CLASSES = 10
SIZE = (375, 500)  # ImageNet's average image, (height, width)


def photo(rng: np.random.Generator) -> Image.Image:
    """Photo-like content: smooth colour fields plus fine detail, about 125 KB as a quality-90 JPEG at 500 x 375."""
    coarse = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize(SIZE[::-1], Image.Resampling.BICUBIC), dtype=np.float32)
    detail = rng.normal(0, 16, (*SIZE, 3))
    return Image.fromarray(np.clip(smooth + detail, 0, 255).astype(np.uint8))


def save(image: Image.Image, path: Path, kind: str) -> None:
    if kind == "png":
        image.save(path.with_suffix(".png"))
    elif kind == "cmyk":
        image.convert("CMYK").save(path, quality=90)
    elif kind == "grayscale":
        image.convert("L").save(path, quality=90)
    else:
        image.save(path, quality=90, progressive=kind == "progressive")


def write_image(task: tuple[Path, int, str]) -> None:
    """Image `index` of the folder: its content and kind (from MIXES[mix]) drawn from its own index, so any process
    may write it."""
    folder, index, mix = task
    rng = np.random.default_rng(index)
    kinds = MIXES[mix]
    kind = list(kinds)[rng.choice(len(kinds), p=list(kinds.values()))]
    save(photo(rng), folder / f"c{index % CLASSES}" / f"{index}.jpg", kind)


def write_folder(root: Path, count: int, mix: str = "harsh") -> Path:
    """ROOT/{train,val}/<class>/<i>.jpg: `count` training images of MIXES[mix] and a tenth as many for validation,
    written on every core."""
    from multiprocessing import Pool

    tasks = []
    for split, total, first in (("train", count, 0), ("val", max(count // 10, 2 * CLASSES), count)):
        for name in range(CLASSES):
            (root / split / f"c{name}").mkdir(parents=True, exist_ok=True)
        tasks += [(root / split, index, mix) for index in range(first, first + total)]
    with Pool(usable_cores()) as pool:
        pool.map(write_image, tasks, chunksize=16)
    return root


@contextlib.contextmanager
def sources(out: Path | None, images: int, mixes: tuple[str, ...] = ("harsh",)) -> Iterator[tuple[Path, dict]]:
    """(the output folder, {source: data spec}): a folder of `images` training images per mix (MIXES), and the first
    mix's folder packed (`mobile-moe pack`, --max-side 256), in `out` or a temporary folder removed at the end."""
    with tempfile.TemporaryDirectory() as scratch:
        root = out or Path(scratch)
        folders = {mix: write_folder(root / ("folder" if mix == "harsh" else f"folder-{mix}-mix"), images, mix)
                   for mix in mixes}  # fmt: skip
        packed = store.pack(open_data(f"imagefolder:{folders[mixes[0]]}", 256), root / "store", max_side=256)
        names = {"harsh": "image folder", "imagenet": "image folder, ImageNet's mix"}
        specs = {names[mix]: f"imagefolder:{folder}" for mix, folder in reversed(folders.items())}
        yield root, specs | {"packed store": f"packed:{packed}"}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def shares(parts: dict | None) -> dict | None:
    """An epoch's parts (training/attribution.py) as shares of its steady window, the window in seconds: what tells
    the next fix (waiting for input, the step's launches on or off the CPU, the loop's own work, the GPU's busy
    share, the thread preparing batches, the pin-memory thread)."""
    if parts is None:
        return None
    window = parts["window_s"]
    return {"window_s": window} | {name.removesuffix("_s"): None if value is None else round(value / window, 4)
                                   for name, value in parts.items() if name != "window_s"}  # fmt: skip


def reported(what: str, measure, *args, **kwargs):
    """measure(*args, **kwargs), or {"error": its first line} where it raises, the traceback on stderr: a GPU call has
    one chance, and the figures after a failed one still run."""
    try:
        return measure(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - reported in the results, and the run goes on
        from train_step import error_line  # this folder is on sys.path: the script's own, or its importer's

        traceback.print_exc()
        line = error_line(error)
        print(f"{what}: failed: {line}", file=sys.stderr, flush=True)
        return {"error": line}


def failures(found) -> list[str]:
    """The error lines anywhere in a report (reported's)."""
    if not isinstance(found, dict):
        return []
    return [found["error"]] if "error" in found else [line for value in found.values() for line in failures(value)]


def finish(report: dict, out: Path) -> int:
    """results.json in `out`; -> the exit status: 1 where a figure failed, its errors in the last line (the one make
    gpu-check's table shows)."""
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    failed = failures(report)
    if failed:
        print(f"{len(failed)} figure(s) failed: {'; '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
