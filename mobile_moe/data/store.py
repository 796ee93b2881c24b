"""A pre-resized image store: `mobile-moe pack SPEC --out STORE`, read back as `--data packed:STORE`.

Every split of a data spec, each image shrunk so its longer side is at most `max_side` (PIL's thumbnail: aspect kept,
never enlarged) and re-encoded as a baseline RGB JPEG (the kind a GPU decodes: decode.py), with the class names,
labels, normalisation, eval resize policy and super-classes of the source. Read many times, it costs a fraction of the
source's decoding (ImageNet's 500 x 375 average becomes 256 x 192, about a quarter of the pixels) and one file per
split instead of one per image. The format (docs/formats.md "Packed image store"):

    STORE/store.json          {"format": "mobile-moe-store", "version": 1, "source", "max_side", "quality",
                               "class_names", "mean", "std", "eval_resize", "super_classes", "splits"}
    STORE/<split>.bin         the split's encoded images, one after another
    STORE/<split>.index.npy   int64 (N, 3): each image's offset and length in <split>.bin, and its label

`open_store` is the one place that checks a store; a damaged image inside one is a one-line UnreadableImage naming
the store, split and index when it is read. pack writes the store as a whole (atomic_path): an interrupted pack
leaves the old store or nothing, and it replaces only a directory that is a store already.
"""

from __future__ import annotations

import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch.utils.data import Dataset

from mobile_moe.atomic import atomic_path, check_writable, within
from mobile_moe.data.decode import fitted
from mobile_moe.data.image_files import image_from_bytes
from mobile_moe.data.spec_options import spec_folder
from mobile_moe.devices import usable_cores
from mobile_moe.errors import UsageError

FORMAT, VERSION = "mobile-moe-store", 1
META = "store.json"
SPLITS = ("train", "val", "test")
DEFAULT_MAX_SIDE, DEFAULT_QUALITY = 256, 90
CHUNK = 256  # images encoded per round of the thread pool


class SplitRecord(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    count: int = Field(ge=0)
    bytes: int = Field(ge=0)


class SuperClassRecord(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    names: list[str] = Field(min_length=1)
    assignment: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)


Unit = Annotated[float, Field(allow_inf_nan=False)]
Spread = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class StoreRecord(BaseModel):
    """store.json (the module docstring); strict: a store we did not write is refused, not guessed at."""

    model_config = ConfigDict(strict=True, extra="forbid")
    format: str
    version: int
    source: str
    max_side: int = Field(ge=1)
    quality: int = Field(ge=1, le=100)
    class_names: list[str] = Field(min_length=1)
    mean: list[Unit] = Field(min_length=3, max_length=3)
    std: list[Spread] = Field(min_length=3, max_length=3)
    eval_resize: dict[str, Any]  # checked by preprocess.check_resize where the store is opened as data
    super_classes: SuperClassRecord | None
    splits: dict[str, SplitRecord]


# --- writing ---------------------------------------------------------------------------------------------------------


def encoded(image, max_side: int, quality: int) -> bytes:
    """A raw image (PIL, or uint8 tensor (3, h, w)) shrunk to `max_side` and encoded as a baseline RGB JPEG."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(image.permute(1, 2, 0).numpy())
    image = fitted(image.convert("RGB"), max_side)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def pack(data, out: str | os.PathLike, *, max_side: int = DEFAULT_MAX_SIDE, quality: int = DEFAULT_QUALITY,
         progress: bool = False) -> Path:  # fmt: skip
    """Write every split of `data` (a Data of open_data(spec, max_side)) into the store `out`; -> out."""
    out = Path(out)
    check_writable(out, directory=True)
    source = spec_folder(data.spec)
    if source is not None and within(out, source):
        raise UsageError(
            f"--out {out} {'is' if within(source, out) else 'is inside'} {source}, the data it packs: the store "
            "would become part of its source; choose a folder outside it"
        )
    if out.is_dir() and any(out.iterdir()) and not (out / META).is_file():
        raise UsageError(f"{out} exists and is not a packed store; choose another --out (nothing there is replaced)")
    record = {"format": FORMAT, "version": VERSION, "source": data.spec, "max_side": max_side, "quality": quality,
              "class_names": list(data.class_names), "mean": list(data.mean), "std": list(data.std),
              "eval_resize": dict(data.eval_resize), "super_classes": _super_record(data), "splits": {}}  # fmt: skip
    with atomic_path(out, directory=True) as tmp:
        for name in SPLITS:
            if name in data.raw_splits:
                record["splits"][name] = _write_split(data.raw_splits[name], tmp, name, max_side, quality, progress)
        (tmp / META).write_text(json.dumps(record, indent=1) + "\n")
    return out


def _super_record(data) -> dict[str, list] | None:
    known = data.super_classes
    return None if known is None else {"names": list(known.names), "assignment": list(known.assignment)}


def _write_split(raw: Dataset, folder: Path, name: str, max_side: int, quality: int, progress: bool) -> dict:
    from tqdm import tqdm

    index = np.zeros((len(raw), 3), dtype=np.int64)
    offset = 0
    def read_and_encode(position: int) -> tuple[bytes, int]:  # on every core: PIL frees the GIL to decode and encode
        image, label = raw[position]
        return encoded(image, max_side, quality), int(label)

    with open(folder / f"{name}.bin", "wb") as file, ThreadPoolExecutor(usable_cores()) as pool:
        bar = tqdm(total=len(raw), desc=f"packing {name}", disable=not progress)
        for start in range(0, len(raw), CHUNK):
            positions = range(start, min(start + CHUNK, len(raw)))
            for position, (blob, label) in zip(positions, pool.map(read_and_encode, positions), strict=True):
                file.write(blob)
                index[position] = (offset, len(blob), label)
                offset += len(blob)
            bar.update(len(positions))
        bar.close()
    np.save(folder / f"{name}.index.npy", index, allow_pickle=False)
    return {"count": len(raw), "bytes": offset}


# --- reading ---------------------------------------------------------------------------------------------------------


class StoreSplit(Dataset):
    """One split of a store: items (PIL image, label), `encoded(i)` the bytes; each process opens the file itself."""

    def __init__(self, path: Path, index: np.ndarray, what: str):
        self.path, self.index, self.what = path, index, what
        self.targets = [int(label) for label in index[:, 2]]
        self._file: tuple[int, Any] | None = None  # (pid, file): a worker process opens its own

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None}

    def encoded(self, position: int) -> bytes:
        if self._file is None or self._file[0] != os.getpid():
            self._file = (os.getpid(), open(self.path, "rb"))  # noqa: SIM115 - kept open for the process's reads
        offset, length, _ = self.index[position]
        return os.pread(self._file[1].fileno(), int(length), int(offset))

    def name(self, position: int) -> str:
        return f"{self.what} image {position}"

    def __getitem__(self, position: int):
        return image_from_bytes(self.encoded(position), self.name(position)), self.targets[position]


def open_store(root: str | os.PathLike, spec: str) -> tuple[StoreRecord, dict[str, StoreSplit]]:
    """The store at `root`, checked whole: store.json, and each split's index against its .bin file; UsageError
    (one line, saying to re-create the store) for anything else."""
    root = Path(root).expanduser()
    again = f"re-create it with `mobile-moe pack SPEC --out {root}`"
    try:
        record = StoreRecord.model_validate_json((root / META).read_bytes())
    except OSError as error:
        reason = error.strerror or error
        raise UsageError(f"{spec}: cannot read {root / META} ({reason}); is it a packed store?") from None
    except ValidationError as error:
        first = error.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise UsageError(f"{spec}: {root / META} is not a store's ({where}: {first['msg']}); {again}") from None
    if (record.format, record.version) != (FORMAT, VERSION) or not set(record.splits) <= set(SPLITS):
        raise UsageError(f"{spec}: {root / META} is not a {FORMAT} version {VERSION} record; {again}")
    known = record.super_classes
    classes = len(record.class_names)
    if known is not None and (len(known.assignment) != classes or max(known.assignment) >= len(known.names)):
        raise UsageError(f"{spec}: {root / META}'s super_classes do not fit its classes; {again}")
    splits = {name: _open_split(root, name, split, classes, spec, again)
              for name, split in record.splits.items()}  # fmt: skip
    return record, splits


def _open_split(root: Path, name: str, split: SplitRecord, classes: int, spec: str, again: str) -> StoreSplit:
    bin_path, index_path = root / f"{name}.bin", root / f"{name}.index.npy"
    try:
        index = np.load(index_path, allow_pickle=False)
        size = bin_path.stat().st_size
    except (OSError, ValueError, EOFError) as error:
        raise UsageError(f"{spec}: cannot read the {name} split ({type(error).__name__}: {error}); {again}") from None
    shaped = isinstance(index, np.ndarray) and index.dtype == np.int64 and index.ndim == 2 and index.shape[1] == 3
    consistent = (
        shaped
        and len(index) == split.count
        and size == split.bytes
        and bool((index[:, :2] >= 0).all())
        and bool((index[:, 1] <= size - index[:, 0]).all())  # offset + length inside the file, without overflow
        and bool(((index[:, 2] >= 0) & (index[:, 2] < classes)).all())
    )
    if not consistent:
        raise UsageError(f"{spec}: the {name} split's index does not match {bin_path.name} (damaged?); {again}")
    return StoreSplit(bin_path, index, f"{spec} {name}")
