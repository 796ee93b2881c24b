"""An image folder's files are all decoded before the work starts; every bad one is reported at once; a file that
decoded is not decoded again until it changes."""

from __future__ import annotations

import json
import os

import pytest
from conftest import write_imagefolder

from mobile_moe.app.cli import main
from mobile_moe.data import image_check
from mobile_moe.data.datasets import open_data
from mobile_moe.errors import UsageError


@pytest.fixture
def folder(tmp_path):
    return write_imagefolder(tmp_path / "folder", {"train": 3, "val": 2}, ("cat", "dog"), (16, 16))


def damage(folder):
    """What the red team found mid-run: a truncated PNG in train/, a text file named like a photo in val/."""
    truncated = folder / "train" / "dog" / "2.png"
    truncated.write_bytes(truncated.read_bytes()[:60])
    (folder / "val" / "cat" / "photo.png").write_text("not an image")


def test_every_bad_file_is_named_before_the_first_step(folder, tmp_path, capsys):
    damage(folder)
    out = tmp_path / "run"
    argv = ["train", "--model", "vit", "--size", "2x32", "--patch", "8", "--image-size", "16", "--recipe", "tiny",
            "--data", f"imagefolder:{folder}", "--out", str(out)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 of 11 image files cannot be read" in err
    assert "train/dog/2.png" in err and "val/cat/photo.png" in err and not out.exists()


def test_a_file_that_decoded_is_stat_only_until_it_changes(folder, monkeypatch):
    decoded = []
    real = image_check.read_image
    monkeypatch.setattr(image_check, "read_image", lambda path: decoded.append(path) or real(path))
    open_data(f"imagefolder:{folder}", 16)
    assert len(decoded) == 10
    decoded.clear()
    open_data(f"imagefolder:{folder}", 16)
    assert decoded == []
    changed = folder / "val" / "dog" / "0.png"
    os.utime(changed, ns=(0, 0))
    open_data(f"imagefolder:{folder}", 16)
    assert decoded == [str(changed)]


@pytest.mark.parametrize("cache_text", ["{", "[]", '{"version": 1, "good": {"train/cat/0.png": [1, "x"]}}', ""])
def test_a_damaged_verdict_cache_is_rebuilt_and_a_bad_file_never_trusted(folder, cache_text):
    open_data(f"imagefolder:{folder}", 16)
    cache = image_check.cache_file(folder)
    cache.write_text(cache_text)
    damage(folder)
    with pytest.raises(UsageError, match="2 of 11"):
        open_data(f"imagefolder:{folder}", 16)
    assert json.loads(cache.read_text())["version"] == image_check.CACHE_VERSION


def test_a_cache_that_cannot_be_written_costs_only_the_check(folder, monkeypatch):
    monkeypatch.setattr(image_check, "cache_root", lambda: folder / "train" / "cat" / "0.png")  # a file, not a dir
    open_data(f"imagefolder:{folder}", 16)


@pytest.mark.parametrize("version", [None, 0, 2, True, "1"])
def test_a_verdict_cache_of_another_version_is_not_trusted_but_rebuilt(folder, monkeypatch, version):
    """A cache, not a user's file: one of another format version, or of none, is never read (its verdicts may mean
    something else) nor refused; every file is decoded again and the cache rewritten at CACHE_VERSION."""
    open_data(f"imagefolder:{folder}", 16)
    cache = image_check.cache_file(folder)
    record = json.loads(cache.read_text())
    assert record["version"] == image_check.CACHE_VERSION == 1 and len(record["good"]) == 10
    record.pop("version")
    cache.write_text(json.dumps(record if version is None else {"version": version, **record}))
    decoded = []
    real = image_check.read_image
    monkeypatch.setattr(image_check, "read_image", lambda path: decoded.append(path) or real(path))
    open_data(f"imagefolder:{folder}", 16)
    assert len(decoded) == 10 and json.loads(cache.read_text()) == {"version": 1, "good": record["good"]}
