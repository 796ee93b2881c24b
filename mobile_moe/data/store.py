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

`open_store` is the one place that checks a store (its store.json through read_record, which refuses a store of
another format version, or of none, in one line); a damaged image inside one is a one-line UnreadableImage naming
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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch.utils.data import Dataset

from mobile_moe.data.decode import fitted
from mobile_moe.data.image_files import image_from_bytes
from mobile_moe.data.spec_options import spec_folder
from mobile_moe.errors import UsageError
from mobile_moe.formats.versions import check_version
from mobile_moe.utils.atomic import atomic_path, check_output_folder, check_writable, within
from mobile_moe.utils.devices import usable_cores
from mobile_moe.utils.foreign_files import open_foreign, read_foreign

FORMAT, VERSION = "mobile-moe-store", 1
META = "store.json"
SPLITS = ("train", "val", "test")
DEFAULT_MAX_SIDE, DEFAULT_QUALITY = 256, 90
CHUNK = 256  # images encoded per round of the thread pool
MAX_RECORD_BYTES = 64 << 20  # store.json: class names and super-classes of up to a million classes
NPY_HEADER_BYTES = 4096  # an .npy header (numpy writes 64 to 128 bytes)


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

    @model_validator(mode="after")
    def _normalises_in_float32(self) -> StoreRecord:
        """mean and std as training uses them, in float32: (x - mean) / std finite for every pixel value x in [0, 1]
        (a std of 1e-300 is 0 there, a mean of 1e300 infinite: positive and finite in float64 is not enough)."""
        with np.errstate(all="ignore"):
            mean, std = np.float32(self.mean), np.float32(self.std)
            ends = (np.float32([[0.0], [1.0]]) - mean) / std
        if not (np.isfinite(ends).all() and (std > 0).all()):
            raise ValueError(f"mean {self.mean} and std {self.std} do not normalise pixels to finite float32 values")
        return self


# --- writing ---------------------------------------------------------------------------------------------------------


def store_files(root: Path) -> set[str] | None:
    """The names a store at `root` holds, from its store.json read and checked as ours; None when it is not one (a
    file of that name someone else wrote included)."""
    try:
        record = read_record(root)
    except UsageError:
        return None
    return {META, *(name for split in record.splits for name in (f"{split}.bin", f"{split}.index.npy"))}


def read_record(root: Path, spec: str | None = None) -> StoreRecord:
    """store.json at `root`, read as a file we did not write and checked whole; UsageError saying why not."""
    where = f"{spec}: " if spec else ""
    again = "pack it again into a new folder (mobile-moe pack SPEC --out NEW_STORE)"
    try:
        text = read_foreign(root / META, limit=MAX_RECORD_BYTES, what=META)
    except UsageError as error:
        raise UsageError(f"{where}{error}; is {root} a packed store?") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        data = None  # not JSON: the schema's parse below says so
    if isinstance(data, dict) and data.get("format") == FORMAT:  # ours: its version before its fields
        check_version(data, VERSION, where=f"{where}{root / META}", what="a packed store's record",
                      fix=again)  # fmt: skip
    try:
        record = StoreRecord.model_validate_json(text)
    except ValidationError as error:
        first = error.errors(include_url=False, include_input=False)[0]
        field = ".".join(str(part) for part in first["loc"])
        problem = (f"{field}: " if field else "") + first["msg"].removeprefix("Value error, ")
        raise UsageError(f"{where}{root / META} is not a store's ({problem}); {again}") from None
    if record.format != FORMAT or not set(record.splits) <= set(SPLITS):
        raise UsageError(f"{where}{root / META} is not a {FORMAT} record; {again}")
    return record


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
    check_output_folder(out, ours=store_files, kind="packed store")
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


def _identity(info: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is replaced or rewritten: its inode, size and modification time."""
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


class StoreChanged(UsageError):
    """A store's images file removed or replaced while a run reads it (a worker's too, as one line)."""


class StoreSplit(Dataset):
    """One split of a store: items (PIL image, label), `encoded(i)` the bytes; each process opens the file itself,
    and checks it is still the file the store was opened with (its identity)."""

    def __init__(self, path: Path, index: np.ndarray, what: str, identity: tuple[int, ...]):
        self.path, self.index, self.what, self.identity = path, index, what, identity
        self.targets = [int(label) for label in index[:, 2]]
        self._fd: tuple[int, int] | None = None  # (pid, fd): a worker process opens its own

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None}

    def __del__(self) -> None:
        if self._fd is not None and self._fd[0] == os.getpid():
            os.close(self._fd[1])

    def _open(self) -> int:
        again = "re-create the store with `mobile-moe pack` if needed, then continue the run with --resume"
        try:
            fd = open_foreign(self.path, what=self.what)
        except UsageError:
            raise StoreChanged(
                f"{self.path} was removed while this run read the store ({self.what}); {again}"
            ) from None
        if _identity(os.fstat(fd)) != self.identity:
            os.close(fd)
            raise StoreChanged(f"{self.path} was replaced while this run read the store ({self.what}): its images are "
                               f"not the ones the run opened; {again}")  # fmt: skip
        return fd

    def encoded(self, position: int) -> bytes:
        if self._fd is None or self._fd[0] != os.getpid():
            self._fd = (os.getpid(), self._open())
        offset, length, _ = self.index[position]
        return os.pread(self._fd[1], int(length), int(offset))

    def name(self, position: int) -> str:
        return f"{self.what} image {position}"

    def __getitem__(self, position: int):
        return image_from_bytes(self.encoded(position), self.name(position)), self.targets[position]


def open_store(root: str | os.PathLike, spec: str) -> tuple[StoreRecord, dict[str, StoreSplit]]:
    """The store at `root`, checked whole: store.json, and each split's index against its .bin file; UsageError
    (one line, saying to re-create the store) for anything else."""
    root = Path(root).expanduser()
    again = f"re-create it with `mobile-moe pack SPEC --out {root}`"
    record = read_record(root, spec)
    known = record.super_classes
    classes = len(record.class_names)
    if known is not None and (len(known.assignment) != classes or max(known.assignment) >= len(known.names)):
        raise UsageError(f"{spec}: {root / META}'s super_classes do not fit its classes; {again}")
    splits = {name: _open_split(root, name, split, classes, spec, again)
              for name, split in record.splits.items()}  # fmt: skip
    return record, splits


def _open_split(root: Path, name: str, split: SplitRecord, classes: int, spec: str, again: str) -> StoreSplit:
    bin_path, index_path = root / f"{name}.bin", root / f"{name}.index.npy"
    limit = NPY_HEADER_BYTES + 24 * split.count  # int64 (N, 3)
    try:
        index = np.load(io.BytesIO(read_foreign(index_path, limit=limit, what=f"{spec} index")), allow_pickle=False)
        fd = open_foreign(bin_path, what=f"{spec} {name} images")  # a regular file, not a FIFO or a device
        info = os.fstat(fd)
        os.close(fd)
        size = info.st_size
    except UsageError as error:
        raise UsageError(f"{error}; {again}") from None
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
    return StoreSplit(bin_path, index, f"{spec} {name}", _identity(info))
