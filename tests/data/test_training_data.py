"""Data specs: built-in digits and synthetic data, image folders, and the errors for missing or bad datasets."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import write_imagefolder

from mobile_moe.data import augment
from mobile_moe.data.datasets import open_data
from mobile_moe.errors import UsageError
from mobile_moe.training.recipes import deit


def test_digits_splits_are_fixed_disjoint_stratified_and_normalised():
    data = open_data("digits", 16)
    assert data.num_classes == 10 and data.class_names[3] == "3"
    sizes = [len(data.split(name)) for name in ("train", "val", "test")]
    assert sum(sizes) == 1797 and sizes[0] > 4 * sizes[1]
    assert all(np.bincount(data.targets(name), minlength=10).min() >= 20 for name in ("val", "test"))
    again = open_data("digits", 16)
    assert data.targets("test") == again.targets("test")
    train = data.raw_splits["train"].images.flatten(1)
    test = data.raw_splits["test"].images.flatten(1)
    assert not (train[:, None, :] == test[None, :200, :]).all(-1).any()  # no test image is a training image
    image, label = data.split("val")[0]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32 and isinstance(label, int)
    stacked = data.normalize()(data.raw_splits["train"].images)  # the whole training split, as split() normalises it
    assert abs(stacked.mean().item()) < 0.05 and abs(stacked.std().item() - 1) < 0.05  # the recorded statistics


def test_normalisation_can_be_overridden_by_a_runs_record():
    data = open_data("digits", 16, mean=[0.5] * 3, std=[0.25] * 3)
    raw, _ = data.raw_splits["val"][0]
    image, _ = data.split("val")[0]
    torch.testing.assert_close(image, (raw.float() / 255 - 0.5) / 0.25)


def test_synthetic_is_deterministic_and_exposes_its_true_super_classes():
    spec = "synthetic:classes=6,super=3,per_class=20,noise=0.05,seed=4"
    a, b = open_data(spec, 16), open_data(spec, 16)
    assert torch.equal(a.raw_splits["train"].images, b.raw_splits["train"].images)
    assert a.num_classes == 6 and a.super_classes.assignment == [0, 0, 1, 1, 2, 2]
    assert a.super_classes.class_names == a.class_names and a.super_classes.method == "dataset"
    other_seed = open_data("synthetic:classes=6,super=3,per_class=20,seed=5", 16)
    assert not torch.equal(a.raw_splits["train"].images, other_seed.raw_splits["train"].images)


def test_synthetic_classes_of_one_super_class_look_alike():
    """The planted hierarchy: mean images of sibling classes are closer than those of classes in other groups."""
    data = open_data("synthetic:classes=4,super=2,per_class=40,noise=0", 16)
    raw = data.raw_splits["train"]
    labels = torch.tensor(raw.targets)
    means = torch.stack([raw.images[labels == c].float().mean(0) for c in range(4)])  # (4, 3, S, S)
    dist = torch.cdist(means.flatten(1), means.flatten(1))
    assert dist[0, 1] < dist[0, 2] and dist[2, 3] < dist[1, 3]


def test_training_transform_augments_and_normalises():
    data = open_data("digits", 16)
    transform = augment.train_transform(deit().augmentation, data)
    raw, _ = data.raw_splits["train"][0]
    torch.manual_seed(0)
    first, second = transform(raw), transform(raw)
    assert first.shape == (3, 16, 16) and first.dtype == torch.float32
    assert not torch.equal(first, second)


def test_imagefolder_reads_train_and_splits_val(tmp_path):
    write_imagefolder(tmp_path, {"train": 4, "val": 4}, ("cat", "dog"), (20, 24))
    data = open_data(f"imagefolder:{tmp_path}", 16)
    assert data.class_names == ["cat", "dog"] and data.super_classes is None
    assert [len(data.split(s)) for s in ("train", "val", "test")] == [8, 4, 4]
    assert sorted(data.targets("val")) == [0, 0, 1, 1]
    assert data.split("test")[0][0].shape == (3, 16, 16)
    assert augment.train_transform(deit().augmentation, data)(data.raw_splits["train"][0][0]).shape == (3, 16, 16)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("mnist", "no data named 'mnist'; did you mean idx"),
        ("digits:extra", "digits takes no options"),
        ("synthetic:classes=4,super=5", "super=5"),
        ("synthetic:colour=3", "unknown option 'colour'"),
        ("synthetic:noise=loud", "not a valid float"),
        ("cifar10:/nonexistent/cifar", "cifar-10-batches-py holds data_batch_1..5"),
        ("cifar100:/nonexistent/cifar", "cifar-100-python holds train, test, meta"),
        ("imagefolder:/nonexistent/imagenet", "put images in /nonexistent/imagenet/train/<class name>"),
    ],
)
def test_bad_or_missing_data_says_what_to_do(spec, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(".", r"\.")):
        open_data(spec, 16)


def test_malformed_cifar_files_are_a_usage_error(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch"):
        (folder / name).write_bytes(b"not a pickle")
    with pytest.raises(UsageError, match="download the python version"):
        open_data(f"cifar10:{folder}", 32)


def test_a_class_folder_whose_name_is_not_utf8_is_refused_when_the_data_opens(tmp_path):
    """Its name could not go into a run's record, a manifest or a plot: refused at the start, naming it, not after
    training (by the manifest's schema, in words that never say which folder)."""
    import os

    write_imagefolder(tmp_path, {"train": 2, "val": 2}, ("plain",), (8, 8))
    for split in ("train", "val"):
        os.rename(tmp_path / split / "plain", os.path.join(os.fsencode(tmp_path / split), b"caf\xe9"))
    with pytest.raises(UsageError, match=r"class name 1 \('caf\\udce9'\) is not UTF-8 text .*rename it"):
        open_data(f"imagefolder:{tmp_path}", 8)


def test_empty_image_folder_is_a_usage_error(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    with pytest.raises(UsageError, match="put images in"):
        open_data(f"imagefolder:{tmp_path}", 16)


def test_a_split_computed_once_holds_exactly_the_items_it_would_compute_each_epoch(monkeypatch):
    """data.materialized: the tiny recipe draws nothing at random, so training computes its images once; the items
    are the per-epoch ones bit for bit, and a split too large for its share of memory is left as it is."""
    from mobile_moe.data import datasets as data_module
    from mobile_moe.training.recipes import tiny

    data = open_data("digits", 16)
    assert not augment.draws_at_random(tiny().augmentation) and augment.draws_at_random(deit().augmentation)
    split = data.split("train", augment.train_transform(tiny().augmentation, data))
    once = data_module.materialized(split)
    assert isinstance(once, data_module.Materialized) and once.targets == split.targets and len(once) == len(split)
    assert all(torch.equal(once[i][0], split[i][0]) and once[i][1] == split[i][1] for i in range(len(split)))
    monkeypatch.setattr(data_module, "memory_limit", lambda: 1000)  # bytes: far below the split's
    assert data_module.materialized(split) is split


def test_channel_statistics_summed_by_chunks_are_the_whole_sets(monkeypatch):
    """A set as large as memory allows is never copied whole to floats; the statistics are the whole set's."""
    from mobile_moe.data import datasets

    images = torch.randint(0, 256, (23, 3, 5, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    x = images.double().div(255).transpose(0, 1).reshape(3, -1)
    whole = tuple(round(v, 4) for v in x.mean(1).tolist()), tuple(round(v, 4) for v in x.std(1).tolist())
    monkeypatch.setattr(datasets, "STATS_CHUNK", 7)  # four chunks, the last of two images
    assert datasets.channel_stats(images) == whole


@pytest.mark.parametrize("target", ["..", "../b"], ids=["a loop", "a second way to a class"])
def test_an_image_folder_reached_twice_through_a_link_is_refused(target, tmp_path):
    """torchvision walks class folders following links: a loop read 10 images as 205, a link to another class
    folder would count its images twice."""
    root = write_imagefolder(tmp_path / "images", {"train": 2, "val": 2}, ("a", "b"), (8, 8))
    (root / "val" / "a" / "link").symlink_to(target)
    with pytest.raises(UsageError, match=r"/val\S* and \S*/val/\S* are one folder \(a symbolic link leads to it"):
        open_data(f"imagefolder:{root}", 8)
    (root / "val" / "a" / "link").unlink()
    shutil.rmtree(root / "train")
    (root / "train").write_text("a file where a folder belongs")
    with pytest.raises(UsageError, match="Not a directory"):
        open_data(f"imagefolder:{root}", 8)
