"""Datasets read from local files, never downloaded: `cifar10:ROOT`, `cifar100:ROOT`, `imagefolder:ROOT`.

Each returns the raw splits (items are (PIL image, label)), the class names and, for CIFAR-100, its 20 coarse labels
(read from the dataset's own pickles: torchvision's class drops them). A missing or broken ROOT is a UsageError that
says which files belong where.
"""

from __future__ import annotations

import difflib
import os
import pickle
import warnings
from pathlib import Path

from torch.utils.data import Dataset, Subset
from torchvision.datasets.folder import IMG_EXTENSIONS

from mobile_moe.data.image_check import check_images
from mobile_moe.data.image_files import read_image
from mobile_moe.errors import Note, UsageError
from mobile_moe.formats.superclasses import SuperClasses, from_labels
from mobile_moe.utils.class_names import class_names_problem

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
CIFAR_FILES = {
    "cifar10": "data_batch_1..5, test_batch, batches.meta",
    "cifar100": "train, test, meta",
}
# Per-channel statistics of the training sets (as used by the torchvision/timm CIFAR recipes).
CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def _cifar_root(name: str, root: str) -> Path:
    """Accept ROOT or ROOT/<extracted folder>; torchvision wants the parent of the extracted folder."""
    path = Path(root).expanduser()
    return path.parent if path.name == CIFAR_FOLDERS[name] else path


def open_cifar(name: str, root: str) -> tuple[Dataset, Dataset, list[str], SuperClasses | None]:
    """-> (official train set, official test set, class names, coarse super-classes for CIFAR-100)."""
    from torchvision.datasets import CIFAR10, CIFAR100

    parent = _cifar_root(name, root)
    cls = CIFAR10 if name == "cifar10" else CIFAR100
    try:
        train = cls(str(parent), train=True, download=False)
        test = cls(str(parent), train=False, download=False)
    except (RuntimeError, OSError, pickle.UnpicklingError, EOFError) as error:
        raise UsageError(
            f"{name}:{root}: no readable {name.upper()} there ({error}); download the python version from "
            f"{CIFAR_URL} and extract it so that {parent / CIFAR_FOLDERS[name]} holds {CIFAR_FILES[name]}"
        ) from None
    coarse = _cifar100_coarse(parent / CIFAR_FOLDERS[name], list(train.classes)) if name == "cifar100" else None
    return train, test, list(train.classes), coarse


def _cifar100_coarse(folder: Path, class_names: list[str]) -> SuperClasses:
    """CIFAR-100's 20 coarse labels as super-classes: fine -> coarse read from the training pickle."""
    with open(folder / "train", "rb") as f:
        entry = pickle.load(f, encoding="latin1")
    with open(folder / "meta", "rb") as f:
        names = pickle.load(f, encoding="latin1")["coarse_label_names"]
    assignment = [0] * len(class_names)
    for fine, coarse in zip(entry["fine_labels"], entry["coarse_labels"], strict=True):
        assignment[fine] = coarse
    return from_labels(assignment, class_names, list(names), "cifar100:coarse")


def check_each_folder_once(root: Path, spec: str) -> None:
    """UsageError if a folder under `root` is reached twice, through a symbolic link to it or to a folder above it:
    torchvision's ImageFolder walks with os.walk(followlinks=True), so its images would count twice, or as often as a
    link loop nests before the path is too long (10 images read as 205)."""
    seen: dict[str, Path] = {}
    stack = [root]
    while stack:
        folder = stack.pop()
        real = os.path.realpath(folder)
        if real in seen:
            raise UsageError(
                f"{spec}: {seen[real]} and {folder} are one folder (a symbolic link leads to it twice): its images "
                "would count twice; remove the link"
            )
        seen[real] = folder
        with os.scandir(folder) as entries:
            stack += [Path(entry.path) for entry in entries if entry.is_dir()]  # is_dir follows links, as os.walk


def check_layout(path: Path, root: str, layout: str) -> None:
    """UsageError unless `path` has a val/ folder, saying what the path is instead: missing, a file, a split folder
    given as the root, or class folders without train/ and val/."""
    spec = f"imagefolder:{root}"
    if not path.exists():
        near = difflib.get_close_matches(path.name, _names(path.parent), n=1)
        hint = f" (did you mean imagefolder:{path.parent / near[0]}?)" if near else ""
        raise UsageError(f"{spec}: the folder {path} does not exist{hint}; {layout}")
    if not path.is_dir():
        raise UsageError(f"{spec}: {path} is a file, not a folder; {layout}")
    if (path / "val").is_dir():
        return
    if path.name in ("train", "val") and (path.parent / "val").is_dir():
        raise UsageError(f"{spec}: {path} is the {path.name} split of {path.parent}: give imagefolder:{path.parent}")
    subfolders = sorted(name for name in _names(path) if (path / name).is_dir())
    if subfolders and "train" not in subfolders:
        raise UsageError(
            f"{spec}: {path} holds class folders ({', '.join(subfolders[:3])}{', ...' if len(subfolders) > 3 else ''})"
            f" but no train/ and val/: move each class's images into {path}/train/<class> and {path}/val/<class> "
            "(val/ is split in half into validation and test)"
        )
    raise UsageError(f"{spec}: {path / 'val'} is missing; {layout}")


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def one_sided_classes(train: list[str], val: list[str]) -> str:
    """Which class folders are in train/ only and which in val/ only."""
    extra = {"train": sorted(set(train) - set(val)), "val": sorted(set(val) - set(train))}
    sides = [f"in {side}/ only: {', '.join(names)}" for side, names in extra.items() if names]
    return (f"train/ and val/ must hold the same class folders; {'; '.join(sides)}: add the missing folders (with "
            "images) or remove the extra ones")  # fmt: skip


def note_skipped(folders: dict, root: str) -> None:
    """A Note counting the files in the class folders that ImageFolder skipped (not an image's extension)."""
    taken = {file for folder in folders.values() for file, _ in folder.samples}
    skipped = []
    for folder in folders.values():
        for class_folder in (Path(folder.root) / name for name in folder.classes):
            skipped += [f for f in sorted(map(str, class_folder.rglob("*"))) if f not in taken and Path(f).is_file()]
    if skipped:
        warnings.warn(
            f"imagefolder:{root}: skipped {len(skipped)} file(s) that are not images by their extension (e.g. "
            f"{skipped[0]}); images are {', '.join(IMG_EXTENSIONS)}",
            Note,
            stacklevel=2,
        )


def open_imagefolder(root: str) -> tuple[Dataset | None, Dataset, list[str]]:
    """ROOT/train/<class>/*.jpg and ROOT/val/<class>/*.jpg (ImageNet layout) -> (train, val, class names). ROOT/val
    alone (ImageNet's validation set) opens too, with train None: enough to evaluate a model or derive its
    super-classes, and a clear error for anything that needs the training split."""
    from torchvision.datasets import ImageFolder

    path = Path(root).expanduser()
    layout = f"put images in {path}/train/<class name>/*.jpg and {path}/val/<class name>/*.jpg"
    check_layout(path, root, layout)
    folders = {}
    for split in ("train", "val") if (path / "train").exists() else ("val",):
        try:
            check_each_folder_once(path / split, f"imagefolder:{root}")
            folders[split] = ImageFolder(str(path / split), loader=read_image)
        except (FileNotFoundError, NotADirectoryError, RuntimeError) as error:
            raise UsageError(f"imagefolder:{root}: {error}; {layout}") from None
        except OSError as error:  # a link loop, a folder that vanished: what was wrong, not a traceback
            raise UsageError(f"imagefolder:{root}: cannot walk {path / split}: {error}") from None
    if "train" in folders and folders["train"].classes != folders["val"].classes:
        raise UsageError(f"imagefolder:{root}: {one_sided_classes(folders['train'].classes, folders['val'].classes)}")
    note_skipped(folders, root)
    problem = class_names_problem(list(folders["val"].classes))  # the folders' names are the classes' names
    if problem is not None:
        raise UsageError(f"imagefolder:{root}: {problem}")
    check_images(path, [file for folder in folders.values() for file, _ in folder.samples], f"imagefolder:{root}")
    return folders.get("train"), folders["val"], list(folders["val"].classes)


def subset(dataset: Dataset, indices) -> Subset:
    return Subset(dataset, [int(i) for i in indices])
