"""`digits-pairs`: 100 classes of two real digits side by side, made offline from scikit-learn's digits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from mobile_moe.app.cli import main
from mobile_moe.data.datasets import SPLITS, open_data, stratified_split
from mobile_moe.errors import UsageError
from mobile_moe.training.run_dir import load_run

SMALL = "digits-pairs:train=300,val=200,test=200"


def test_classes_are_balanced_in_every_split_and_named_by_their_number():
    data = open_data("digits-pairs", 32)
    assert data.class_names == [f"{c:02d}" for c in range(100)]
    for name, size in {"train": 6000, "val": 1000, "test": 4000}.items():
        counts = np.bincount(data.targets(name), minlength=100)
        assert counts.sum() == size and counts.min() == counts.max() == size // 100
    uneven = open_data("digits-pairs:train=250,val=100,test=100", 16)
    counts = np.bincount(uneven.targets("train"), minlength=100)
    assert counts.max() - counts.min() == 1


def _halves(image: torch.Tensor) -> list[bytes]:
    """The two 8x8 digits of a 16x16 pair image (rows 4..11), as the source's 0..16 values."""
    grey = image[0].float().mul(16 / 255).round().to(torch.uint8)
    return [grey[4:12, :8].numpy().tobytes(), grey[4:12, 8:].numpy().tobytes()]


def test_each_split_pairs_only_its_own_source_digits():
    """At 16 px the canvas is not resized: every half of every image is one of its split's source digits, and the
    source digits are split before pairing (the same stratified split as `digits`)."""
    digits = load_digits()
    parts = stratified_split(digits.target, (0.7, 0.15, 0.15))
    assert sum(len(part) for part in parts) == len(set(np.concatenate(parts))) == len(digits.target)
    source = {
        name: {digits.images[i].astype(np.uint8).tobytes() for i in part}
        for name, part in zip(SPLITS, parts, strict=True)
    }
    data = open_data(SMALL, 16)
    for name in SPLITS:
        images = data.raw_splits[name].images
        for index in range(len(images)):
            assert set(_halves(images[index])) <= source[name]
        labels = data.targets(name)
        tens = {int(digits.target[i]) for i in parts[SPLITS.index(name)]}
        assert {label // 10 for label in labels} <= tens


def test_pairs_are_deterministic_in_the_seed():
    first, again = open_data(SMALL, 16), open_data(SMALL, 16)
    other = open_data(SMALL + ",seed=1", 16)
    for name in SPLITS:
        assert torch.equal(first.raw_splits[name].images, again.raw_splits[name].images)
        assert first.targets(name) == again.targets(name)
    assert not torch.equal(first.raw_splits["train"].images, other.raw_splits["train"].images)


def test_coarse_super_classes_are_the_tens_digit():
    coarse = open_data(SMALL, 16).super_classes
    assert coarse.names == [f"{tens}x" for tens in range(10)]
    assert coarse.assignment == [c // 10 for c in range(100)]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("digits-pairs:train=50", "train=50 must be between 100"),
        ("digits-pairs:pairs=3", "unknown option 'pairs'"),
        ("digits-pairs:test=many", "not a valid int"),
    ],
)
def test_bad_options_say_what_to_do(spec, message):
    with pytest.raises(UsageError, match=message):
        open_data(spec, 16)


def test_a_mobile_vmoe_trains_on_it_with_the_coarse_super_classes(tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--model", "mobile-vmoe", "--size", "3x64", "--patch", "8", "--image-size", "16", "--data", SMALL,
            "--super-classes", "coarse", "--experts", "10", "--moe-layers", "1", "--recipe", "tiny",
            "--epochs", "1", "--batch-size", "64", "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    run = load_run(out)
    assert run.config["model"]["num_classes"] == 100 and run.config["data"]["spec"] == SMALL
