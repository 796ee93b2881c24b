"""`fashion-mnist[:ROOT]` and `idx:ROOT`: sets of IDX files, built here (the suite does not need Debian's package)."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from mobile_moe.app.cli import main
from mobile_moe.data.datasets import open_data
from mobile_moe.data.idx_files import FILE_ENDINGS, fashion_mnist_class_names
from mobile_moe.errors import UsageError
from mobile_moe.training.run_dir import load_run

PER_CLASS = {"train": 20, "test": 4}  # per class: 200 training images (180 train, 20 val) and 40 test images


def idx_bytes(values: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, values.ndim]) + b"".join(struct.pack(">I", size) for size in values.shape)
    return header + values.astype(np.uint8).tobytes()


def write_set(root: Path, labels: dict[str, np.ndarray], compress: bool = True, prefix: str = "") -> Path:
    """Four IDX files in `root`: each image's pixels are its label (so a test can check images follow labels) plus
    its index within the split, mod 7."""
    root.mkdir(parents=True, exist_ok=True)
    for split, split_labels in labels.items():
        images = (split_labels[:, None, None] * 20 + np.arange(len(split_labels))[:, None, None] % 7) * np.ones(
            (1, 28, 28), dtype=np.int64
        )
        for kind, values in (("images", images), ("labels", split_labels)):
            name = prefix + FILE_ENDINGS[(split, kind)] + (".gz" if compress else "")
            data = idx_bytes(values)
            (root / name).write_bytes(gzip.compress(data) if compress else data)
    return root


def balanced(classes, per_class: int) -> np.ndarray:
    return np.random.default_rng(0).permutation(np.repeat(np.asarray(classes), per_class))


@pytest.fixture
def fashion_root(tmp_path) -> Path:
    return write_set(tmp_path / "fashion", {split: balanced(range(10), n) for split, n in PER_CLASS.items()})


def test_fashion_mnist_has_its_names_a_stratified_val_split_and_the_coarse_groups(fashion_root):
    data = open_data(f"fashion-mnist:{fashion_root}", 32)
    assert data.class_names[:3] == ["T-shirt/top", "Trouser", "Pullover"] and data.num_classes == 10
    for split, per_class in {"train": 18, "val": 2, "test": 4}.items():
        assert np.bincount(data.targets(split), minlength=10).tolist() == [per_class] * 10
    image, label = data.raw_splits["train"][0]
    assert image.shape == (3, 28, 28) and image.dtype == torch.uint8 and int(image[0, 0, 0]) // 20 == label
    assert data.split("test")[0][0].shape == (3, 32, 32)  # stretched to the model's size as it is read
    coarse = data.super_classes
    assert coarse.names == ["tops", "footwear", "trouser", "dress", "bag"]
    groups = {name: [data.class_names[c] for c in coarse.members(i)] for i, name in enumerate(coarse.names)}
    assert groups["footwear"] == ["Sandal", "Sneaker", "Ankle boot"]
    assert groups["tops"] == ["T-shirt/top", "Pullover", "Coat", "Shirt"]


def test_the_default_root_takes_options_after_a_comma_as_the_synopsis_writes_them(fashion_root, monkeypatch):
    """fashion-mnist[:ROOT][,train=N,...]: without ROOT, `fashion-mnist,train=50` (and the colon form) both work."""
    from mobile_moe.data import idx_files

    monkeypatch.setattr(idx_files, "FASHION_MNIST_ROOT", str(fashion_root))
    comma, colon = open_data("fashion-mnist,train=50,test=20", 16), open_data("fashion-mnist:train=50,test=20", 16)
    assert len(comma.targets("train")) == 50 and comma.targets("test") == colon.targets("test")
    assert comma.spec == "fashion-mnist,train=50,test=20"


def test_subsets_are_stratified_and_plain_files_read_as_gzipped_ones(tmp_path):
    labels = {split: balanced(range(10), n) for split, n in PER_CLASS.items()}
    gzipped = open_data(f"fashion-mnist:{write_set(tmp_path / 'gz', labels)},train=50,test=20", 16)
    plain = open_data(f"fashion-mnist:{write_set(tmp_path / 'plain', labels, compress=False)},train=50,test=20", 16)
    assert np.bincount(gzipped.targets("train")).tolist() == [5] * 10
    assert np.bincount(gzipped.targets("test")).tolist() == [2] * 10 and len(gzipped.targets("val")) == 20
    for split in ("train", "val", "test"):
        assert torch.equal(gzipped.raw_splits[split].images, plain.raw_splits[split].images)


def test_any_idx_set_is_named_by_its_label_values(tmp_path):
    """EMNIST's letters are labelled 1..26 and its files carry a prefix."""
    root = write_set(
        tmp_path / "letters", {s: balanced(range(1, 5), n) for s, n in PER_CLASS.items()}, prefix="emnist-"
    )
    data = open_data(f"idx:{root}", 28)
    assert data.class_names == ["1", "2", "3", "4"] and data.super_classes is None
    image, label = data.raw_splits["test"][0]
    assert int(image[0, 0, 0]) // 20 == label + 1


def _rewrite(root: Path, role: tuple[str, str], change) -> None:
    path = root / (FILE_ENDINGS[role] + ".gz")
    path.write_bytes(change(gzip.decompress(path.read_bytes()), path))


def _gz(data: bytes) -> bytes:
    return gzip.compress(data)


DAMAGE = {
    "bad magic number": (("train", "images"), lambda d, p: _gz(b"\0\0\x0d\x03" + d[4:]), "magic number is 00000d03"),
    "a truncated file": (("train", "images"), lambda d, p: _gz(d[:-100]), "holds 156700 bytes of values"),
    "bytes beyond the header's count": (("test", "labels"), lambda d, p: _gz(d + b"\1"), "holds more bytes"),
    "a broken gzip stream": (("test", "images"), lambda d, p: p.read_bytes()[:-30], "cannot read it as an IDX file"),
    "labels and images of different counts": (
        ("train", "labels"), lambda d, p: _gz(idx_bytes(np.zeros(199, dtype=np.uint8))), "holds 200 images but"),
    "a header promising terabytes": (
        ("train", "images"), lambda d, p: _gz(b"\0\0\x08\x03" + struct.pack(">III", 2**31, 2**15, 2**15)), "promises"),
    "another set's labels": (("test", "labels"), lambda d, p: _gz(d[:-1] + b"\x0c"), "label 12, but Fashion-MNIST"),
}  # fmt: skip


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_file_is_one_line_and_exit_2(fashion_root, damage, capsys):
    role, change, message = DAMAGE[damage]
    _rewrite(fashion_root, role, change)
    with pytest.raises(UsageError, match=message):
        open_data(f"fashion-mnist:{fashion_root}", 16)
    out = fashion_root.parent / "run"
    argv = ["train", "--model", "vit", "--image-size", "32", "--patch", "8", "--data", f"fashion-mnist:{fashion_root}"]
    assert main([*argv, "--out", str(out)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("fashion-mnist:{root}/nowhere", "apt-get install dataset-fashion-mnist"),
        ("idx:", "give one folder"),
        ("idx:{root},{root}", "give one folder"),
        ("fashion-mnist:{root},train=5", "fewer images than the 10 classes"),
        ("fashion-mnist:{root},crop=3", "unknown option 'crop'"),
        ("fashion-mnist:{root},train=-1", "must be an integer from 0"),
    ],
)
def test_bad_specs_say_what_to_do(fashion_root, spec, message):
    with pytest.raises(UsageError, match=message):
        open_data(spec.format(root=fashion_root), 16)


def test_a_folder_without_one_of_the_files_names_it(fashion_root):
    (fashion_root / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(UsageError, match=r"no file named \*t10k-labels-idx1-ubyte"):
        open_data(f"idx:{fashion_root}", 16)
    (fashion_root / "t10k-labels-idx1-ubyte").write_bytes(b"")
    (fashion_root / "x-t10k-labels-idx1-ubyte").write_bytes(b"")
    with pytest.raises(UsageError, match="2 files"):
        open_data(f"idx:{fashion_root}", 16)


def test_a_fifo_in_place_of_a_file_is_refused_not_read(fashion_root):
    """Opening a FIFO for reading would wait for a writer forever."""
    (fashion_root / "t10k-labels-idx1-ubyte.gz").unlink()
    os.mkfifo(fashion_root / "t10k-labels-idx1-ubyte")
    with pytest.raises(UsageError, match="not a regular file"):
        open_data(f"fashion-mnist:{fashion_root}", 16)


def test_a_mobile_vmoe_trains_on_it_with_the_coarse_super_classes(fashion_root, tmp_path):
    out, spec = tmp_path / "run", f"fashion-mnist:{fashion_root}"
    argv = ["train", "--model", "mobile-vmoe", "--size", "2x32", "--patch", "8", "--image-size", "16", "--data", spec,
            "--super-classes", "coarse", "--experts", "5", "--moe-layers", "1", "--recipe", "tiny",
            "--epochs", "1", "--batch-size", "64", "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    run = load_run(out)
    assert run.config["data"]["class_names"] == fashion_mnist_class_names()
    assert run.config["super_classes"]["names"] == ["tops", "footwear", "trouser", "dress", "bag"]
