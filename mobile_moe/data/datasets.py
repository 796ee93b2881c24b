"""Data specs (docs/formats.md) -> `Data`: three splits, class names, normalisation, and super-classes when known.

    digits                        scikit-learn's 1,797 real 8x8 digits, resized, 3 channels (offline; demo and tests)
    digits-pairs[:train=N,val=M,test=K,seed=S]   two real digits side by side, 100 classes (digits_pairs.py)
    synthetic[:classes=C,super=S,per_class=N,noise=X,seed=K]   planted class -> super-class hierarchy (synthetic.py)
    fashion-mnist[:ROOT][,train=N,val=M,test=K]   Fashion-MNIST's IDX files (idx_files.py); ROOT defaults to Debian's
    idx:ROOT[,train=N,val=M,test=K]   any set of IDX files (MNIST, KMNIST, EMNIST)
    cifar10:ROOT, cifar100:ROOT   local CIFAR files; CIFAR-100 brings its 20 coarse labels as super-classes
    imagefolder:ROOT              ROOT/train and ROOT/val; val is halved into val (held out) and test
    packed:STORE                  a store of `mobile-moe pack SPEC --out STORE`: SPEC's splits, pre-resized (store.py)

Splits: `train`, `val` (model selection and super-class derivation) and `test`, fixed and stratified. `split(name)`
gives un-augmented, normalised float images (3, S, S) with int labels; training passes its own transform for train.
Evaluation resizes by the data's eval resize policy (mobile_moe/preprocess.py): imagefolder images (any size) are
resized and centre-cropped ImageNet-style; everything else is stretched to S x S (a no-op for the in-memory datasets
and CIFAR at 32, whose images already are S x S). config.json records the policy (`data_record`), and export hands it
on to the bundle's manifest, so predict resizes an image file as evaluation did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Dataset

from mobile_moe import preprocess
from mobile_moe.data import digits_pairs, folders, idx_files, synthetic
from mobile_moe.data.spec_options import EXAMPLES, FOLDER_SPECS, refusal, resolved_spec, unknown_name
from mobile_moe.errors import UsageError
from mobile_moe.formats.superclasses import SuperClasses, from_labels
from mobile_moe.utils.devices import memory_limit, over_memory_limit

SPLITS = ("train", "val", "test")
SPLIT_SEED = 0  # the train/val/test splits never change with the training seed


class ImageTensors(Dataset):
    """In-memory uint8 images (N, 3, S, S) and labels; items are (image (3, S, S) uint8, label)."""

    def __init__(self, images: torch.Tensor, labels: np.ndarray):
        self.images = images
        self.targets = [int(label) for label in labels]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        return self.images[index], self.targets[index]


class Transformed(Dataset):
    """A raw dataset with a transform applied to each image; labels pass through as ints."""

    def __init__(self, raw: Dataset, transform: Callable, targets: list[int]):
        self.raw = raw
        self.transform = transform
        self.targets = targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        image, label = self.raw[index]
        return self.transform(image), int(label)


class Materialized(Dataset):
    """Every item of a deterministic dataset, computed once and kept as one tensor: the same items as the dataset's
    own, without its per-item cost each epoch (a 28 px image stretched and normalised costs about 0.1 ms, six seconds
    an epoch of Fashion-MNIST, far more than a small model's step on a GPU)."""

    def __init__(self, dataset: Dataset, targets: list[int]):
        first = dataset[0][0]
        self.images = torch.empty((len(dataset), *first.shape), dtype=first.dtype)  # filled in place: no second copy
        for index in range(len(dataset)):
            self.images[index] = dataset[index][0]
        self.targets = list(targets)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        return self.images[index], self.targets[index]


IN_MEMORY_SHARE = 0.25  # of memory_limit(), for one split of one process
_processes_sharing_memory = 1


def share_memory_with(processes: int) -> None:
    """This process is one of `processes` training side by side (reproduce --jobs): each split's share of memory is
    divided among them."""
    global _processes_sharing_memory
    _processes_sharing_memory = max(1, processes)


def materialized(dataset: Dataset) -> Dataset:
    """`dataset` (items (image tensor, label) from a transform that draws nothing at random) computed once, when its
    images fit IN_MEMORY_SHARE of memory_limit() (divided among processes side by side); else `dataset` itself,
    computing each item as it is read."""
    if len(dataset) == 0:
        return dataset
    image = dataset[0][0]
    share = IN_MEMORY_SHARE / _processes_sharing_memory
    if len(dataset) * image.numel() * image.element_size() > share * memory_limit():
        return dataset
    return Materialized(dataset, dataset.targets)


@dataclass
class Data:
    spec: str
    image_size: int
    class_names: list[str]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    raw_splits: dict[str, Dataset]  # items (uint8 tensor or PIL image, label), not yet resized or normalised
    eval_resize: dict = field(default_factory=preprocess.stretch)  # the policy bringing a raw image to (3, S, S)
    super_classes: SuperClasses | None = None  # provided by the dataset itself (synthetic truth, CIFAR-100 coarse)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def targets(self, name: str) -> list[int]:
        raw = self.raw_split(name)
        return list(raw.targets) if hasattr(raw, "targets") else _subset_targets(raw)

    @property
    def resize_for_eval(self) -> list:
        """v2 transforms bringing a raw image to (3, S, S) by the eval resize policy."""
        return preprocess.resize_steps(self.eval_resize, self.image_size)

    def normalize(self):
        """uint8 image -> float in [0, 1] -> (x - mean) / std: the last steps of every pipeline (and of export's)."""
        return preprocess.normalize(self.mean, self.std)

    def eval_transform(self):
        """Raw image -> normalised (3, S, S): the same transform export's predict builds from a bundle's manifest."""
        return preprocess.eval_transform(self.eval_resize, self.image_size, self.mean, self.std)

    def split(self, name: str, transform: Callable | None = None) -> Dataset:
        """Items (image float (3, S, S), label int). Un-augmented unless a (training) `transform` is given; a given
        transform receives the raw image and must resize and normalise it itself (see augment.train_transform)."""
        raw = self.raw_split(name)
        return Transformed(raw, transform or self.eval_transform(), self.targets(name))

    def raw_split(self, name: str) -> Dataset:
        if name not in SPLITS:
            raise UsageError(f"split {name!r}: choose one of {', '.join(SPLITS)}")
        if name not in self.raw_splits:
            raise UsageError(
                f"--data {self.spec} has no {name} split (an imagefolder without ROOT/{name}?): add it, or use data "
                f"that has one"
            )
        return self.raw_splits[name]


def _subset_targets(subset) -> list[int]:
    return [int(subset.dataset.targets[i]) for i in subset.indices]


def _strata(labels: np.ndarray, parts: int) -> np.ndarray | None:
    """The labels to stratify `parts` parts by, or None (a plain shuffle) when some class has fewer images than that."""
    counts = np.bincount(labels)
    return labels if counts[counts > 0].min() >= parts else None


def stratified_split(labels: np.ndarray, fractions: tuple[float, ...], seed: int = SPLIT_SEED) -> list[np.ndarray]:
    """Indices for each part, sized by `fractions` (summing to 1), every class spread evenly, deterministic."""
    from sklearn.model_selection import train_test_split

    labels = np.asarray(labels)
    stratify = _strata(labels, len(fractions))
    rest, parts = np.arange(len(labels)), []
    remaining = 1.0
    for fraction in fractions[:-1]:
        strata = None if stratify is None else labels[rest]
        take, rest = train_test_split(rest, train_size=fraction / remaining, random_state=seed, stratify=strata)
        parts.append(np.sort(take))
        remaining -= fraction
    return [*parts, np.sort(rest)]


STATS_CHUNK = 4096  # images per chunk of channel_stats: a float copy of a whole large set would not fit in memory


def channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std (unbiased) of uint8 images (N, 3, S, S) in [0, 1] units, std floored to keep it
    invertible; summed in float64 a chunk of images at a time, so a set as large as memory allows is never copied
    whole."""
    total, squares = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for chunk in images.split(STATS_CHUNK):
        x = chunk.to(torch.float64).transpose(0, 1).reshape(3, -1)  # (3, n*S*S), 0..255
        total += x.sum(1)
        squares += x.square().sum(1)
    count = images.numel() // 3
    mean = total / count
    variance = (squares - count * mean.square()) / max(count - 1, 1)
    std = variance.clamp(min=0).sqrt() / 255
    return tuple(round(v, 4) for v in (mean / 255).tolist()), tuple(round(max(v, 1e-3), 4) for v in std.tolist())


def in_memory(spec, image_size, images: np.ndarray, labels: np.ndarray, class_names, super_classes=None) -> Data:
    """Split in-memory images 70/15/15 (stratified); statistics from the training part only."""
    images = torch.from_numpy(images)
    parts = stratified_split(labels, (0.7, 0.15, 0.15))
    splits = {name: ImageTensors(images[idx], labels[idx]) for name, idx in zip(SPLITS, parts, strict=True)}
    return _with_train_stats(spec, image_size, splits, class_names, super_classes)


def _with_train_stats(spec, image_size, splits: dict[str, ImageTensors], class_names, super_classes) -> Data:
    """In-memory splits as Data, normalised by the training split's statistics, stretched for evaluation."""
    mean, std = channel_stats(splits["train"].images)
    return Data(spec, image_size, list(class_names), mean, std, splits, preprocess.stretch(), super_classes)


def open_digits_pairs(spec: str, argument: str, image_size: int) -> Data:
    """Pairs drawn within each split of the source digits (split as `digits` splits them), balanced over 100 classes;
    the tens digit as coarse super-classes."""
    from sklearn.datasets import load_digits

    options = digits_pairs.parse_digits_pairs(argument)
    digits = load_digits()
    parts = stratified_split(digits.target, (0.7, 0.15, 0.15))
    source = {name: (digits.images[idx], digits.target[idx]) for name, idx in zip(SPLITS, parts, strict=True)}
    splits = {
        name: ImageTensors(grey_images(canvases, image_size), labels)
        for name, (canvases, labels) in digits_pairs.generate(options, source).items()
    }
    names = digits_pairs.class_names()
    coarse = from_labels(digits_pairs.coarse_assignment(), names, digits_pairs.coarse_names(), f"{spec}:coarse")
    return _with_train_stats(spec, image_size, splits, names, coarse)


def grey_images(pixels: np.ndarray, image_size: int) -> torch.Tensor:
    """Grey images (N, h, w) in scikit-learn digits' 0..16 -> uint8 (N, 3, S, S): scaled to 0..255, resized
    (bilinear), the grey copied to 3 channels."""
    too_much = over_memory_limit(3 * len(pixels) * image_size**2 * 4)  # up to 3 float copies: resize, round, clamp
    if too_much:
        raise UsageError(f"{len(pixels)} images of {image_size} x {image_size} pixels need {too_much}; choose a "
                         "smaller image size (--image-size, or pack's --max-side)")  # fmt: skip
    grey = torch.from_numpy(np.asarray(pixels)).float().mul(255 / 16)[:, None]  # (N, 1, h, w) in [0, 255]
    grey = torch.nn.functional.interpolate(grey, size=(image_size, image_size), mode="bilinear")  # (N, 1, S, S)
    return grey.round().clamp(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()


def open_digits(spec: str, image_size: int) -> Data:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = grey_images(digits.images, image_size)
    return in_memory(spec, image_size, images.numpy(), digits.target, [str(d) for d in range(10)])


def open_synthetic(spec: str, argument: str, image_size: int) -> Data:
    options = synthetic.parse_synthetic(argument)
    images, labels = synthetic.generate(options, image_size)
    names = synthetic.class_names(options)
    truth = from_labels(options.assignment, names, synthetic.super_class_names(options), f"{spec}:truth")
    return in_memory(spec, image_size, images, labels, names, truth)


def open_idx(spec: str, dataset: str, argument: str, image_size: int) -> Data:
    """The official training file split 90/10 into train and val (stratified, as CIFAR's), its test file as test; each
    cut to the spec's subset sizes. Images stay at their own size (grey copied to 3 channels) and are stretched to S
    as they are read. Fashion-MNIST brings its coarse groups (tops, footwear, ...) as super-classes."""
    default_root = idx_files.FASHION_MNIST_ROOT if dataset == "fashion-mnist" else None
    root, subsets = idx_files.parse_idx_spec(dataset, argument, default_root)
    paths = idx_files.find_files(root, dataset)
    train_images, train_labels = idx_files.read_split(paths, "train")
    test_images, test_labels = idx_files.read_split(paths, "test")
    names, train_labels, test_labels = idx_files.class_labels(dataset, paths, train_labels, test_labels)
    train_idx, val_idx = stratified_split(train_labels, (0.9, 0.1))
    parts = {
        "train": (train_images, train_labels, train_idx),
        "val": (train_images, train_labels, val_idx),
        "test": (test_images, test_labels, np.arange(len(test_labels))),
    }
    sizes = subset_sizes(spec, dataset, subsets, len(names))
    splits = {}
    for name, (images, labels, indices) in parts.items():
        indices = stratified_subset(indices, labels[indices], sizes[name])
        grey = torch.from_numpy(images[indices])[:, None]  # (N, 1, H, W) uint8
        splits[name] = ImageTensors(grey.expand(-1, 3, -1, -1).contiguous(), labels[indices])
    coarse = None
    if dataset == "fashion-mnist":
        assignment, groups = idx_files.fashion_mnist_coarse()
        coarse = from_labels(assignment, names, groups, f"{dataset}:coarse")
    return _with_train_stats(spec, image_size, splits, names, coarse)


def subset_sizes(spec: str, dataset: str, subsets: idx_files.IdxSubsets, num_classes: int) -> dict[str, int]:
    """Each split's subset size, checked: 0 (all) or at least one image per class, as a stratified subset needs."""
    for name, size in subsets.sizes().items():
        if 0 < size < num_classes:
            problem = f"{name}={size} is fewer images than the {num_classes} classes; give at least {num_classes}"
            raise refusal(spec, problem, EXAMPLES[dataset])
    return subsets.sizes()


def stratified_subset(indices: np.ndarray, labels: np.ndarray, size: int) -> np.ndarray:
    """`size` of `indices` (0 or more than there are: all), every class kept in proportion, deterministic."""
    if size == 0 or size >= len(indices):
        return indices
    from sklearn.model_selection import train_test_split

    return np.sort(train_test_split(indices, train_size=size, random_state=SPLIT_SEED, stratify=_strata(labels, 2))[0])


def open_cifar(spec: str, name: str, root: str, image_size: int) -> Data:
    train, test, names, coarse = folders.open_cifar(name, root)
    train_idx, val_idx = stratified_split(np.asarray(train.targets), (0.9, 0.1))
    splits = {"train": folders.subset(train, train_idx), "val": folders.subset(train, val_idx), "test": test}
    mean, std = folders.CIFAR_STATS[name]
    return Data(spec, image_size, names, mean, std, splits, preprocess.stretch(), coarse)


def open_imagefolder(spec: str, root: str, image_size: int) -> Data:
    train, val, names = folders.open_imagefolder(root)
    val_idx, test_idx = stratified_split(np.asarray(val.targets), (0.5, 0.5))
    splits = {"val": folders.subset(val, val_idx), "test": folders.subset(val, test_idx)}
    if train is not None:
        splits["train"] = train
    mean, std = folders.IMAGENET_STATS
    return Data(spec, image_size, names, mean, std, splits, preprocess.resize_center_crop(image_size), None)


def open_packed(spec: str, root: str, image_size: int) -> Data:
    """A store written by `mobile-moe pack` (store.py): the source's splits, names, statistics and super-classes."""
    from mobile_moe.data import store

    record, splits = store.open_store(root, spec)
    known = record.super_classes
    coarse = None if known is None else from_labels(known.assignment, record.class_names, known.names, f"{spec}:coarse")
    eval_resize = preprocess.check_resize(_at_size(record.eval_resize, image_size), image_size, f"{spec} eval_resize")
    mean, std = tuple(record.mean), tuple(record.std)
    return Data(spec, image_size, record.class_names, mean, std, splits, eval_resize, coarse)


def _at_size(record: dict, image_size: int) -> dict:
    """A store's eval resize policy (recorded at the size it was packed at) for a model of `image_size`."""
    if record.get("policy") != preprocess.RESIZE_CENTER_CROP:
        return record
    return preprocess.resize_center_crop(image_size, interpolation=record.get("interpolation"))


OPTIONS_ONLY = ("digits-pairs", "synthetic")  # NAME[:k=v,...]: all that follows the name is options, after ":"


def _name_and_argument(spec: str) -> tuple[str, str]:
    """ "NAME:ARGUMENT" -> (NAME, ARGUMENT). fashion-mnist's options may follow its name after "," (its ROOT being
    optional: the synopsis's fashion-mnist[:ROOT][,k=v,...]); digits-pairs' and synthetic's may not (nothing
    optional comes before them), which is refused with the spec as it should be written."""
    name, _, argument = spec.partition(":")
    head, comma, options = name.partition(",")
    if comma and head == "fashion-mnist":
        return head, options + (f":{argument}" if argument else "")
    if comma and head in OPTIONS_ONLY:
        fixed = f"{head}:{spec[len(head) + 1 :]}"
        raise UsageError(f"data spec {spec!r}: options follow ':' after {head}, not ','; write {fixed}")
    return name, argument


def _open_spec(spec: str, image_size: int) -> Data:
    """The data `spec` names, by its name's opener. A name DATA_SPECS lacks, a part the name forbids (digits:...) or
    a folder it requires and lacks (cifar10:ROOT) is refused here, naming that part."""
    name, argument = _name_and_argument(spec)
    if name == "digits":
        if argument:
            raise refusal(spec, f"digits takes no options, yet {argument!r} follows it", EXAMPLES["digits"])
        return open_digits(spec, image_size)
    if name == "digits-pairs":
        return open_digits_pairs(spec, argument, image_size)
    if name == "synthetic":
        return open_synthetic(spec, argument, image_size)
    if name in ("fashion-mnist", "idx"):
        return open_idx(spec, name, argument, image_size)
    if name not in FOLDER_SPECS:
        raise unknown_name(spec, name)
    if not argument:
        raise refusal(spec, f"no folder after '{name}:'", EXAMPLES[name])
    if name == "imagefolder":
        return open_imagefolder(spec, argument, image_size)
    if name == "packed":
        return open_packed(spec, argument, image_size)
    return open_cifar(spec, name, argument, image_size)


def open_data(spec: str, image_size: int, mean=None, std=None, eval_resize=None) -> Data:
    """Open a data spec at `image_size`. `mean`/`std` override the dataset's own statistics and `eval_resize` its eval
    resize policy (a run's recorded ones)."""
    if not isinstance(image_size, int) or image_size < 1:
        raise UsageError(f"image size {image_size!r}: must be a positive integer")
    data = _open_spec(spec, image_size)
    data.spec = resolved_spec(spec)
    if mean is not None:
        data.mean = tuple(float(v) for v in mean)
    if std is not None:
        data.std = tuple(float(v) for v in std)
    if eval_resize is not None:
        data.eval_resize = preprocess.check_resize(eval_resize, image_size, "data.eval_resize")
    return data


def data_record(data: Data) -> dict:
    """What config.json keeps about the data: enough for export and evaluation to rebuild the input pipeline."""
    return {
        "spec": data.spec,
        "image_size": data.image_size,
        "mean": list(data.mean),
        "std": list(data.std),
        "class_names": list(data.class_names),
        "eval_resize": dict(data.eval_resize),
    }
