"""IDX files, the format of MNIST, Fashion-MNIST, KMNIST and EMNIST: `fashion-mnist[:ROOT]` and `idx:ROOT`.

ROOT holds the four standard files, gzipped or not: `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
`t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte` (a prefix such as EMNIST's `emnist-balanced-` is allowed, one
set per folder). Debian's `dataset-fashion-mnist` package puts Fashion-MNIST's under FASHION_MNIST_ROOT.

An IDX file is a header (two zero bytes, a type byte, the number of dimensions n, then n big-endian uint32 sizes)
followed by the product of the sizes in values of that type. Only unsigned bytes (type 0x08) are read: every image
and label file of those sets is. A file that is not one (bad magic number, other type or rank, fewer or more bytes
than its header promises, a broken gzip stream, images and labels of different counts) is one line naming the file.
What a header promises is read only if it fits in a quarter of this machine's memory, so a forged header or a gzip
bomb is refused before it is decompressed.
"""

from __future__ import annotations

import gzip
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mobile_moe.data.spec_options import EXAMPLES, parse_options
from mobile_moe.errors import UsageError
from mobile_moe.utils.devices import over_memory_limit

FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_INSTALL = "apt-get install dataset-fashion-mnist"
# The files of one set: (split, kind) -> the name's ending; `t10k` is the test split.
FILE_ENDINGS = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}
UNSIGNED_BYTE = 0x08
GZIP_MAGIC = b"\x1f\x8b"
CHUNK = 1 << 20

# Fashion-MNIST's labels 0..9 (torchvision.datasets.FashionMNIST.classes, read there so the names are the usual ones)
# grouped as people shop for them: the coarse super-classes of `--super-classes coarse`.
FASHION_MNIST_COARSE = {
    "tops": ("T-shirt/top", "Pullover", "Coat", "Shirt"),
    "footwear": ("Sandal", "Sneaker", "Ankle boot"),
    "trouser": ("Trouser",),
    "dress": ("Dress",),
    "bag": ("Bag",),
}


def fashion_mnist_class_names() -> list[str]:
    from torchvision.datasets import FashionMNIST

    return list(FashionMNIST.classes)


def fashion_mnist_coarse() -> tuple[list[int], list[str]]:
    """-> (class -> coarse group, the groups' names), in FASHION_MNIST_COARSE's order."""
    group_of = {name: group for group, (_, names) in enumerate(FASHION_MNIST_COARSE.items()) for name in names}
    return [group_of[name] for name in fashion_mnist_class_names()], list(FASHION_MNIST_COARSE)


def find_files(root: str, dataset: str) -> dict[tuple[str, str], Path]:
    """ROOT -> the path of each of the four files; a missing folder or file is one line saying what belongs there."""
    folder = Path(root).expanduser()
    get = f" ({FASHION_MNIST_INSTALL} puts them in {FASHION_MNIST_ROOT})" if dataset == "fashion-mnist" else ""
    if not folder.is_dir():
        raise UsageError(
            f"{dataset}: no folder {root!r}; it must hold the four IDX files{get}; e.g. --data {EXAMPLES[dataset]}"
        )
    names = sorted(entry.name for entry in folder.iterdir())
    found = {}
    for role, ending in FILE_ENDINGS.items():
        matches = [name for name in names if name.removesuffix(".gz").endswith(ending)]
        if len(matches) != 1:
            what = "no file" if not matches else f"{len(matches)} files ({', '.join(matches)})"
            raise UsageError(f"{dataset}: {what} named *{ending}[.gz] in {folder}; it must hold one{get}")
        found[role] = folder / matches[0]
        if not found[role].is_file():  # a FIFO would block the read forever; a directory has no bytes to read
            raise UsageError(f"{found[role]}: not a regular file; it must be the set's {ending} file")
    return found


def read_idx(path: Path, rank: int) -> np.ndarray:
    """An IDX file of unsigned bytes with `rank` dimensions -> uint8 array of its sizes, checked as the module says."""
    try:
        with open(path, "rb") as raw:
            gzipped = raw.read(2) == GZIP_MAGIC
        with gzip.open(path, "rb") if gzipped else open(path, "rb") as stream:
            sizes = _header(stream, path, rank)
            values = _values(stream, path, math.prod(sizes))
    except (OSError, EOFError, zlib.error) as error:  # gzip.BadGzipFile is an OSError
        raise UsageError(f"{path}: cannot read it as an IDX file ({error}); get the set's files again") from None
    return values.reshape(sizes)


def _header(stream, path: Path, rank: int) -> tuple[int, ...]:
    magic = stream.read(4)
    if len(magic) < 4 or magic[:2] != b"\0\0" or magic[2] != UNSIGNED_BYTE or magic[3] != rank:
        raise UsageError(
            f"{path}: not an IDX file of unsigned bytes with {rank} dimension(s) (its magic number is "
            f"{magic.hex() or 'missing'}, expected 0000{UNSIGNED_BYTE:02x}{rank:02x}); get the set's files again"
        )
    header = stream.read(4 * rank)
    if len(header) < 4 * rank:
        raise UsageError(f"{path}: its header ends early; get the set's files again")
    return tuple(int.from_bytes(header[4 * i : 4 * i + 4], "big") for i in range(rank))


def _values(stream, path: Path, count: int) -> np.ndarray:
    """Read exactly `count` bytes, in chunks so that a lying header costs only what the file really holds."""
    excess = over_memory_limit(count)
    if excess is not None:
        raise UsageError(
            f"{path}: its header promises values of {excess}; a damaged file, or a set too large for this machine"
        )
    data = bytearray()
    while len(data) < count and (chunk := stream.read(min(CHUNK, count - len(data)))):
        data += chunk
    if len(data) < count or stream.read(1):
        held = f"{len(data)} bytes" if len(data) < count else "more bytes"
        raise UsageError(
            f"{path}: holds {held} of values where its header promises {count}; a truncated or damaged file, get "
            "the set's files again"
        )
    return np.frombuffer(bytes(data), dtype=np.uint8)


def read_split(files: dict[tuple[str, str], Path], split: str) -> tuple[np.ndarray, np.ndarray]:
    """-> (images uint8 (N, H, W), labels int64 (N,)) of one split, their counts checked against each other."""
    images = read_idx(files[(split, "images")], 3)
    labels = read_idx(files[(split, "labels")], 1)
    if len(images) != len(labels):
        raise UsageError(
            f"{files[(split, 'images')]} holds {len(images)} images but {files[(split, 'labels')]} {len(labels)} "
            "labels; the files are of different sets, or damaged"
        )
    if len(images) == 0 or min(images.shape[1:]) == 0:
        raise UsageError(f"{files[(split, 'images')]} holds no images, or images of no pixels ({images.shape})")
    return images, labels.astype(np.int64)


@dataclass(frozen=True)
class IdxSubsets:
    """At most this many images of each split (0: all), a stratified subset: a CPU run on a part of the set."""

    train: int = 0
    val: int = 0
    test: int = 0  # parse_options refuses a negative size, as it does every option's

    def sizes(self) -> dict[str, int]:
        return {"train": self.train, "val": self.val, "test": self.test}


def parse_idx_spec(dataset: str, argument: str, default_root: str | None) -> tuple[str, IdxSubsets]:
    """ "ROOT,train=6000" -> (ROOT, IdxSubsets(train=6000)); ROOT is the one item without "=" (it may not hold ",")."""
    items = argument.split(",") if argument else []
    roots = [item for item in items if "=" not in item]
    options = ",".join(item for item in items if "=" in item)
    problem = _root_problem(roots, default_root)
    if problem:
        raise UsageError(
            f"{dataset}: {problem}; give one folder, then any of train=N,val=M,test=K; e.g. --data {EXAMPLES[dataset]}"
        )
    return (roots[0] if roots else default_root), parse_options(IdxSubsets, options, dataset, EXAMPLES[dataset])


def _root_problem(roots: list[str], default_root: str | None) -> str | None:
    """What is wrong with the items of a spec taken for its folder, or None: one folder, or none where one defaults."""
    if len(roots) > 1:
        return f"{len(roots)} folders ({', '.join(map(repr, roots))})"
    if roots and not roots[0]:
        return "an empty folder (a stray ',')"
    if not roots and default_root is None:
        return "no folder"
    return None


def class_labels(dataset: str, files: dict[tuple[str, str], Path], train: np.ndarray, test: np.ndarray):
    """-> (class names, train labels, test labels) with labels 0..C-1. Fashion-MNIST's labels are its 10 classes;
    another set's classes are the label values its training file holds, named by their values (EMNIST's letters
    start at 1)."""
    if dataset == "fashion-mnist":
        names = fashion_mnist_class_names()
        for split, labels in (("train", train), ("test", test)):
            if labels.max() >= len(names):
                raise UsageError(
                    f"{files[(split, 'labels')]}: label {labels.max()}, but Fashion-MNIST has {len(names)} classes; "
                    "these are another set's files: use --data idx:ROOT"
                )
        return names, train, test
    values = np.unique(train)
    unseen = np.setdiff1d(np.unique(test), values)
    if unseen.size:
        raise UsageError(
            f"{files[('test', 'labels')]}: label {unseen[0]} never occurs in {files[('train', 'labels')]}; the "
            "files are of different sets"
        )
    return [str(value) for value in values], np.searchsorted(values, train), np.searchsorted(values, test)
