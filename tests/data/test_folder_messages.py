"""imagefolder's refusals name the thing that is wrong: a missing root (and the folder meant), a split given as the
root, class folders without train/ and val/, a class folder on one side only; files it skips are counted."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mobile_moe.data.datasets import open_data
from mobile_moe.errors import Note, UsageError


def write_folder(root: Path, train=("cat", "dog"), val=("cat", "dog")) -> Path:
    for split, classes in (("train", train), ("val", val)):
        for name in classes:
            (root / split / name).mkdir(parents=True)
            for i in range(2):
                Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(root / split / name / f"{i}.png")
    return root


def refusal(spec: str) -> str:
    with pytest.raises(UsageError) as caught:
        open_data(spec, 16)
    return str(caught.value)


def test_a_missing_root_is_named_with_the_folder_meant(tmp_path):
    write_folder(tmp_path / "photos")
    message = refusal(f"imagefolder:{tmp_path / 'phtos'}")
    meant = f"(did you mean imagefolder:{tmp_path / 'photos'}?)"
    assert f"the folder {tmp_path / 'phtos'} does not exist {meant}" in message


def test_a_split_given_as_the_root_points_at_its_parent(tmp_path):
    root = write_folder(tmp_path / "photos")
    assert f"is the train split of {root}: give imagefolder:{root}" in refusal(f"imagefolder:{root / 'train'}")


def test_class_folders_without_splits_say_how_to_lay_them_out(tmp_path):
    for name in ("cat", "dog"):
        (tmp_path / "flat" / name).mkdir(parents=True)
    message = refusal(f"imagefolder:{tmp_path / 'flat'}")
    assert "holds class folders (cat, dog) but no train/ and val/" in message and "val/ is split in half" in message


def test_a_class_folder_on_one_side_is_named(tmp_path):
    root = write_folder(tmp_path / "photos", train=("cat", "dog", "fox"), val=("cat", "dog", "owl"))
    assert "in train/ only: fox; in val/ only: owl" in refusal(f"imagefolder:{root}")


def test_skipped_files_are_counted_in_a_note(tmp_path):
    root = write_folder(tmp_path / "photos")
    (root / "train" / "cat" / "notes.txt").write_text("not an image")
    (root / "val" / "dog" / "Thumbs.db").write_bytes(b"\0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        open_data(f"imagefolder:{root}", 16)
    notes = [str(w.message) for w in caught if issubclass(w.category, Note)]
    assert len(notes) == 1 and "skipped 2 file(s) that are not images" in notes[0]


def test_a_class_folder_that_is_a_link_loop_is_one_line(tmp_path):
    root = write_folder(tmp_path / "photos")
    (root / "train" / "b").symlink_to("c")
    (root / "train" / "c").symlink_to("b")
    assert "Too many levels of symbolic links" in refusal(f"imagefolder:{root}")
