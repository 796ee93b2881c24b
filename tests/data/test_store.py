"""The pre-resized image store (mobile_moe/data/store.py): `mobile-moe pack` round-trips every split's labels, class
names, statistics and super-classes; images come back shrunk to --max-side; damage is one line, and a pack never
replaces what is not a store."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import FILE_KINDS, write_image_kind
from PIL import Image

from mobile_moe.app.cli import main
from mobile_moe.data import store
from mobile_moe.data.datasets import open_data
from mobile_moe.data.image_files import UnreadableImage
from mobile_moe.errors import UsageError

SOURCE = "digits-pairs:train=200,val=100,test=100"  # real, smooth images (JPEG is made for them), super-classes


@pytest.fixture
def packed(tmp_path):
    return store.pack(open_data(SOURCE, 16), tmp_path / "store", max_side=16)


def test_a_store_round_trips_splits_labels_names_and_super_classes(packed):
    source, back = open_data(SOURCE, 16), open_data(f"packed:{packed}", 16)
    assert back.class_names == source.class_names and (back.mean, back.std) == (source.mean, source.std)
    assert back.super_classes.assignment == source.super_classes.assignment
    assert back.eval_resize == source.eval_resize
    for split in ("train", "val", "test"):
        assert back.targets(split) == source.targets(split)
        original, stored = source.raw_splits[split][0][0], back.raw_splits[split][0][0]
        pixels = torch.from_numpy(np.array(stored)).permute(2, 0, 1)
        assert pixels.shape == original.shape and (pixels.float() - original.float()).abs().mean() < 8  # JPEG 90


def test_images_are_shrunk_to_max_side_with_their_aspect(tmp_path):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in ("a", "b"):
            (tmp_path / "folder" / split / name).mkdir(parents=True)
            for index, kind in enumerate(FILE_KINDS):
                pixels = rng.integers(0, 256, (30, 60, 3), dtype=np.uint8)
                suffix = "png" if kind == "png" else "jpg"  # ImageFolder takes images by their extension
                write_image_kind(tmp_path / "folder" / split / name / f"{index}-{kind}.{suffix}", kind, pixels)
    out = store.pack(open_data(f"imagefolder:{tmp_path / 'folder'}", 20), tmp_path / "store", max_side=20)
    data = open_data(f"packed:{out}", 16)
    image, label = data.raw_splits["train"][0]
    assert image.size == (20, 10) and data.class_names == ["a", "b"] and label == 0
    assert data.eval_resize == open_data(f"imagefolder:{tmp_path / 'folder'}", 16).eval_resize


def test_the_cli_packs_and_refuses_a_directory_that_is_not_a_store(tmp_path, capsys):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    assert main(["pack", SOURCE, "--out", str(theirs)]) == 2
    assert "is not a packed store" in capsys.readouterr().err and (theirs / "notes.txt").read_text() == "mine"
    assert main(["pack", SOURCE, "--out", str(tmp_path / "store"), "--max-side", "8"]) == 0
    assert main(["pack", SOURCE, "--out", str(tmp_path / "store"), "--max-side", "12"]) == 0  # a store: replaced
    assert json.loads((tmp_path / "store" / "store.json").read_text())["max_side"] == 12
    assert sorted(path.name for path in tmp_path.iterdir()) == ["store", "theirs"]  # no temporaries left
    store_dir = tmp_path / "store"
    files = {path.name: path.read_bytes() for path in store_dir.iterdir()}
    for out in (store_dir, store_dir / "inner"):  # a store packed into itself, or into its own folder
        assert main(["pack", f"packed:{store_dir}", "--out", str(out)]) == 2
        assert "the data it packs: the store would become part of its source" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in store_dir.iterdir()} == files
    loop = tmp_path / "loop"
    loop.symlink_to(loop)  # --out under a symbolic-link loop: one line (Path.resolve raised RuntimeError)
    assert main(["pack", f"packed:{store_dir}", "--out", str(loop / "store")]) == 2
    assert "cannot write" in capsys.readouterr().err


def damage_json(packed):
    (packed / "store.json").write_text('{"format": "mobile-moe-store"')


def damage_index(packed):
    index = np.load(packed / "train.index.npy")
    index[3, 2] = 100  # a label past the 100 classes
    np.save(packed / "train.index.npy", index)


def truncate_bin(packed):
    with open(packed / "val.bin", "r+b") as file:
        file.truncate(100)


def pickled_index(packed):
    np.save(packed / "test.index.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)


def edit_json(change):
    def damage(packed):
        record = json.loads((packed / "store.json").read_text())
        change(record)
        (packed / "store.json").write_text(json.dumps(record))

    damage.__name__ = change.__name__
    return damage


def no_assignment(record):
    record["super_classes"].pop("assignment")


def zero_std(record):
    record["std"][1] = 0.0


def assignment_past_the_names(record):
    record["super_classes"]["assignment"][0] = 99


def offsets_that_overflow(packed):
    index = np.load(packed / "train.index.npy")
    index[2, :2] = 2**62
    np.save(packed / "train.index.npy", index)


def npz_as_index(packed):
    index = np.load(packed / "val.index.npy")
    with open(packed / "val.index.npy", "wb") as file:
        np.savez(file, index=index)  # a zip archive under the .npy name: np.load hands back an NpzFile


DAMAGE = [damage_json, damage_index, truncate_bin, pickled_index, offsets_that_overflow, npz_as_index,
          *(edit_json(change) for change in (no_assignment, zero_std, assignment_past_the_names))]  # fmt: skip


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda damage: damage.__name__)
def test_a_damaged_store_is_one_line(packed, damage):
    damage(packed)
    with pytest.raises(Exception) as raised:
        open_data(f"packed:{packed}", 16)
    message = str(raised.value)
    assert type(raised.value).__name__ == "UsageError" and "\n" not in message and "mobile-moe pack" in message


@pytest.mark.parametrize(
    ("version", "held"),
    [
        (None, "of format version 0 (it states none)"),
        (0, "of format version 0"),
        (2, "of format version 2 (written by a newer mobile-moe)"),
    ],
)
def test_a_store_of_another_format_version_is_refused_in_one_line(packed, tmp_path, capsys, version, held):
    """store.json states its format version; read_record, the one check of it, refuses another (or none) before its
    fields, through open_data and any command that reads the store, and the store is left as it is."""
    record = json.loads((packed / "store.json").read_text())
    assert record["version"] == 1
    record.pop("version")
    (packed / "store.json").write_text(json.dumps(record if version is None else {**record, "version": version}))
    newer = "upgrade mobile-moe, or " if version == 2 else ""
    refusal = (f"packed:{packed}: {packed / 'store.json'} is a packed store's record {held}; this mobile-moe reads "
               f"version 1: {newer}pack it again into a new folder (mobile-moe pack SPEC --out NEW_STORE)")  # fmt: skip
    with pytest.raises(UsageError) as caught:
        open_data(f"packed:{packed}", 16)
    assert str(caught.value) == refusal
    files = {path.name: path.read_bytes() for path in packed.iterdir()}
    assert main(["pack", f"packed:{packed}", "--out", str(tmp_path / "again")]) == 2
    assert capsys.readouterr().err == f"mobile-moe pack: error: {refusal}\n"
    assert {path.name: path.read_bytes() for path in packed.iterdir()} == files and not (tmp_path / "again").exists()


def test_a_damaged_image_inside_a_store_names_it(packed):
    index = np.load(packed / "train.index.npy")
    offset, length, _ = index[5]
    with open(packed / "train.bin", "r+b") as file:
        file.seek(int(offset))
        file.write(b"\x00" * int(length))
    data = open_data(f"packed:{packed}", 16)
    with pytest.raises(UnreadableImage, match=rf"cannot read packed:{packed} train image 5: "):
        data.raw_splits["train"][5]
    assert isinstance(data.raw_splits["train"][4][0], Image.Image)


def test_pack_replaces_only_a_store_of_ours_holding_nothing_else(tmp_path, capsys):
    """A folder is a store by its store.json's content, not its name: someone else's store.json beside their files
    is refused and kept; a note kept inside a real store is named and kept; a link given as --out is refused."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "store.json").write_text('{"their": "settings"}')
    (theirs / "photo.jpg").write_bytes(b"theirs")
    assert main(["pack", SOURCE, "--out", str(theirs)]) == 2
    assert "is not a packed store" in capsys.readouterr().err
    assert sorted(p.name for p in theirs.iterdir()) == ["photo.jpg", "store.json"]
    store = tmp_path / "store"
    assert main(["pack", SOURCE, "--out", str(store), "--max-side", "8"]) == 0
    (store / "NOTES.md").write_text("where this came from")
    assert main(["pack", SOURCE, "--out", str(store), "--max-side", "12"]) == 2
    assert "also holds NOTES.md, which we did not write" in capsys.readouterr().err
    assert (store / "NOTES.md").read_text() == "where this came from"
    (store / "NOTES.md").unlink()
    (tmp_path / "link").symlink_to(store)
    assert main(["pack", SOURCE, "--out", str(tmp_path / "link"), "--max-side", "12"]) == 2
    assert "is a symbolic link" in capsys.readouterr().err and (tmp_path / "link").is_symlink()
    assert json.loads((store / "store.json").read_text())["max_side"] == 8


@pytest.mark.parametrize("kind", ["fifo", "device", "giant"])
def test_a_store_part_that_is_no_regular_file_or_too_large_is_one_line(tmp_path, kind):
    """Nothing we read blocks us or grows without bound: a FIFO, a link to an endless device and a sparse giant in
    place of a store's index or images file are refused when the store opens."""
    store = packed_store(tmp_path)
    part = store / ("train.index.npy" if kind != "device" else "train.bin")
    part.unlink()
    if kind == "fifo":
        os.mkfifo(part)
    elif kind == "device":
        part.symlink_to("/dev/zero")
    else:
        with open(part, "wb") as file:
            file.truncate(1 << 40)
    with pytest.raises(UsageError, match="a FIFO|a character device|more than"):
        open_data(f"packed:{store}", 8)


def test_a_store_removed_or_replaced_while_a_run_reads_it_is_named_so(tmp_path):
    store = packed_store(tmp_path)
    train = open_data(f"packed:{store}", 8).raw_splits["train"]
    bin_path = store / "train.bin"
    copy = bin_path.read_bytes()
    bin_path.unlink()
    with pytest.raises(UsageError, match="was removed while this run read the store"):
        train.encoded(0)
    bin_path.write_bytes(copy[::-1])  # another file of the same size in its place
    with pytest.raises(UsageError, match="was replaced while this run read the store"):
        train.encoded(0)


@pytest.mark.parametrize("field, value", [("std", 1e-300), ("mean", 1e300), ("std", 1e-44)])
def test_a_stores_normalisation_is_checked_in_float32(tmp_path, field, value):
    """Positive and finite in float64, yet 0 or inf in the float32 training computes in: refused by name."""
    store = packed_store(tmp_path)
    record = json.loads((store / "store.json").read_text())
    record[field] = [value] * 3
    (store / "store.json").write_text(json.dumps(record))
    with pytest.raises(UsageError, match="do not normalise pixels to finite float32 values"):
        open_data(f"packed:{store}", 8)


def packed_store(tmp_path):
    return store.pack(open_data(SOURCE, 16), tmp_path / "store", max_side=16)
