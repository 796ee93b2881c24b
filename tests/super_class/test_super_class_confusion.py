"""Confusion matrices (hard and soft, from a tiny model), files, the confusion graph, derive and the file format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model

from mobile_moe.errors import UsageError
from mobile_moe.formats.confusion import check_confusion, confusion_from_predictions, load_confusion
from mobile_moe.formats.superclasses import load
from mobile_moe.super_class.derive import derive_super_classes
from mobile_moe.super_class.graph import class_affinity
from mobile_moe.super_class.planted import planted_confusion


@pytest.fixture(scope="module")
def predictions():
    """Softmax outputs of a tiny (untrained) model on random images: (probs (24, 7), labels (24,))."""
    model = tiny_model("vit").eval()
    images = torch.randn(24, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        probs = model(images).logits.softmax(-1)
    labels = torch.arange(24) % 6  # class 6 has no images
    return probs, labels


def test_hard_confusion_counts_argmax(predictions):
    probs, labels = predictions
    hard = confusion_from_predictions(probs, labels, hard=True)
    expected = np.zeros((7, 7))
    for label, predicted in zip(labels.tolist(), probs.argmax(-1).tolist(), strict=True):
        expected[label, predicted] += 1
    assert np.array_equal(hard, expected)


def test_soft_confusion_sums_probabilities(predictions):
    probs, labels = predictions
    soft = confusion_from_predictions(probs, labels)
    hard = confusion_from_predictions(probs, labels, hard=True)
    assert np.allclose(soft.sum(1), hard.sum(1))  # both rows sum to the images per class
    assert np.allclose(soft[2], probs[labels == 2].sum(0).double().numpy())
    assert np.count_nonzero(soft[:6]) > np.count_nonzero(hard)  # soft has signal where argmax has none
    assert soft[6].sum() == 0 and hard[6].sum() == 0


def test_soft_is_default_and_differs_from_hard(predictions):
    probs, labels = predictions
    assert not np.allclose(confusion_from_predictions(probs, labels), confusion_from_predictions(probs, labels, True))


@pytest.mark.parametrize(
    "probs, labels, message",
    [
        (np.full((3, 4), 0.25), np.array([0, 1]), "labels must be"),
        (np.ones((3, 4)), np.array([0, 1, 2]), "sum to 1"),
        (np.full((3, 4), 0.25), np.array([0, 1, 4]), "labels must be integers"),
        (np.zeros((0, 4)), np.zeros(0, dtype=int), "N, C > 0"),
    ],
)
def test_bad_predictions(probs, labels, message):
    with pytest.raises(UsageError, match=message):
        confusion_from_predictions(probs, labels)


@pytest.mark.parametrize("suffix", [".npy", ".csv"])
def test_file_round_trip(tmp_path, suffix):
    matrix = planted_confusion(30, 3, seed=0).confusion
    matrix[0, 1] = 0.125  # probabilities are fine too
    path = tmp_path / f"confusion{suffix}"
    names = [f"c{i}" for i in range(30)] if suffix == ".csv" else None
    if suffix == ".npy":
        np.save(path, matrix)
    else:  # a header row of class names, then the rows
        np.savetxt(path, matrix, delimiter=",", header=",".join(names), comments="")
    loaded, loaded_names = load_confusion(path)
    assert np.array_equal(loaded, matrix)
    assert loaded_names == names


def test_super_class_file_round_trip(tmp_path):
    planted = planted_confusion(40, 4, seed=1)
    derived = derive_super_classes(planted.confusion, 4, class_names=[f"n{i}" for i in range(40)], source="test")
    derived.save(tmp_path / "sc.json")
    loaded = load(tmp_path / "sc.json")
    assert loaded == derived
    assert loaded.quality["sizes"] == np.bincount(loaded.assignment).tolist()
    assert 0 < loaded.quality["chance_share"] < loaded.quality["within_confusion_share"] <= 1


@pytest.mark.parametrize(
    "matrix, message",
    [
        (np.zeros((3, 4)), "square"),
        (np.zeros((0, 0)), "non-empty"),
        (np.zeros(5), "2-D"),
        (np.array([[1.0, -1.0], [0.0, 1.0]]), "negative"),
        (np.array([[1.0, np.nan], [0.0, 1.0]]), "NaN"),
        (np.eye(3), "no off-diagonal"),
        (np.array([[1.0]]), "at least 2"),
    ],
)
def test_bad_matrices(matrix, message):
    with pytest.raises(UsageError, match=message):
        check_confusion(matrix)


def test_unreadable_files(tmp_path):
    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"not a numpy file")
    with pytest.raises(UsageError, match="cannot read"):
        load_confusion(garbage)
    with pytest.raises(UsageError, match="does not exist"):
        load_confusion(tmp_path / "missing.npy")
    with pytest.raises(UsageError, match=r"\.npy or \.csv"):
        load_confusion(tmp_path / "matrix.txt")
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("1,2\n3\n")
    with pytest.raises(UsageError, match="different numbers of columns"):
        load_confusion(ragged)
    words = tmp_path / "words.csv"
    words.write_text("a,b\n1,x\n2,3\n")
    with pytest.raises(UsageError, match="not a number"):
        load_confusion(words)


def test_class_names_must_match():
    with pytest.raises(UsageError, match="3 class names for a 30-class"):
        derive_super_classes(planted_confusion(30, 3).confusion, 3, class_names=["a", "b", "c"])


def test_class_without_images_is_named_and_still_clustered_by_its_column():
    planted = planted_confusion(60, 3, noise=0.05, seed=2)
    confusion = planted.confusion.copy()
    confusion[5] = 0.0  # class 5 has no validation images; others are still predicted as it
    derived = derive_super_classes(confusion, 3)
    assert derived.quality["classes_without_images"] == [5]
    partners = np.argsort(-confusion[:, 5])[:3]  # classes most often predicted as class 5
    assert derived.assignment[5] == derived.assignment[int(partners[0])]


def test_confusion_graph():
    confusion = np.array([[8.0, 2.0, 0.0], [0.0, 5.0, 5.0], [1.0, 0.0, 9.0]])
    graph = class_affinity(confusion)  # the confusion graph's weights, as a matrix
    assert not np.diagonal(graph).any()  # diagonal ignored
    assert graph[0][1] == pytest.approx(0.5 * 0.2)  # row-normalised 2/10, symmetrised with 0
    assert graph[1][2] == pytest.approx(0.5 * 0.5)
    assert graph[0][2] == pytest.approx(0.5 * 0.1)
    assert np.allclose(class_affinity(confusion), class_affinity(confusion).T)


def test_csv_class_names_with_commas_quotes_and_spaces_round_trip(tmp_path):
    """The header is read by the csv module, as the csv module (or a spreadsheet) writes it."""
    import csv

    names = ["T-shirt, top", 'the "coat"', " leading space", "plain"]
    matrix = np.eye(4) * 5 + 1
    path = tmp_path / "confusion.csv"
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(names)
        writer.writerows(matrix.tolist())
    loaded, loaded_names = load_confusion(path)
    assert loaded_names == names and np.array_equal(loaded, matrix)


def test_a_csv_header_of_numbers_is_the_class_names_when_the_rows_say_so(tmp_path):
    """Class names that are numbers (digits-pairs' "00" to "99") still head a square matrix: one row more than
    columns."""
    path = tmp_path / "confusion.csv"
    path.write_text("00,01,10\n5,1,0\n1,5,1\n0,1,5\n")
    matrix, names = load_confusion(path)
    assert names == ["00", "01", "10"] and matrix.shape == (3, 3)
    path.write_text("5,1,0\n1,5,1\n0,1,5\n")  # no header: the same rows as numbers
    assert load_confusion(path)[1] is None


@pytest.mark.parametrize("first", ["alpha", '"al,pha"'])
def test_a_csv_saved_with_a_byte_order_mark_keeps_its_first_class_name(tmp_path, first):
    """Excel's "CSV UTF-8" starts with a byte-order mark: it is no part of the first name, quoted or not."""
    path = tmp_path / "confusion.csv"
    path.write_bytes(f"{first},beta,gamma\n5,1,0\n1,5,1\n0,1,5\n".encode("utf-8-sig"))
    _, names = load_confusion(path)
    assert names == [first.strip('"'), "beta", "gamma"]
