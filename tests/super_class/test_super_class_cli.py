"""`mobile-moe superclass derive|show`: from a confusion file and from a run directory; every bad input exits 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import tiny_model

from mobile_moe.app.cli import main
from mobile_moe.data.datasets import data_record, open_data
from mobile_moe.errors import UsageError
from mobile_moe.formats.confusion import check_confusion_output, save_confusion
from mobile_moe.formats.superclasses import load
from mobile_moe.models.checkpoint import checkpoint_dict, save_checkpoint
from mobile_moe.super_class.demo import derive_for_demo
from mobile_moe.super_class.planted import planted_confusion
from mobile_moe.training.evaluate import confusion_from_run
from mobile_moe.training.run_dir import write_config
from mobile_moe.utils.plot_files import read_figure


@pytest.fixture(scope="module")
def confusion_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("confusion") / "confusion.npy"
    np.save(path, planted_confusion(60, 4, noise=0.1, seed=0).confusion)
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as training writes it, with an untrained tiny dense model on `digits` (10 classes)."""
    run_dir = tmp_path_factory.mktemp("run")
    model = tiny_model("vit", num_classes=10)
    config = {"model": model.config.to_dict(), "data": data_record(open_data("digits", 32)), "recipe": {}}
    config["super_classes"] = None
    write_config(run_dir, config)
    save_checkpoint(checkpoint_dict(model), run_dir / "best.pt")
    return run_dir


def test_derive_from_confusion_file_then_show(confusion_file, tmp_path, capsys):
    out, plot = tmp_path / "sc.json", tmp_path / "sc.png"
    args = ["superclass", "derive", "--confusion", str(confusion_file), "--num-super-classes", "4"]
    assert main([*args, "--out", str(out), "--plot", str(plot), "--seed", "1"]) == 0
    super_classes = load(out)
    assert super_classes.num_super_classes == 4 and super_classes.num_classes == 60
    assert super_classes.method == "spectral" and super_classes.source.startswith("confusion:")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["superclass", "show", str(out)]) == 0
    listing = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in listing[2:6]]
    assert [int(row[0]) for row in rows] == [0, 1, 2, 3]
    assert [int(row[1]) for row in rows] == [len(super_classes.members(s)) for s in range(4)]
    assert all(line.count("class ") >= 3 for line in listing[2:6])  # three example class names each, and the rest
    assert all(f", +{int(row[1]) - 3} more  " in line for line, row in zip(listing[2:6], rows, strict=True))
    assert "confusion inside super-classes" in listing[-1]


@pytest.mark.parametrize("method", ["louvain", "balanced"])
def test_derive_methods_and_class_names(confusion_file, tmp_path, method):
    names = tmp_path / "names.txt"
    names.write_text("\n".join(f"thing {i}" for i in range(60)) + "\n")
    out = tmp_path / "sc.json"
    args = ["superclass", "derive", "--confusion", str(confusion_file), "-E", "5", "--method", method]
    assert main([*args, "--class-names", str(names), "--out", str(out)]) == 0
    super_classes = load(out)
    assert super_classes.method == method and super_classes.class_names[7] == "thing 7"


def test_show_is_seeded(confusion_file, tmp_path, capsys):
    out = tmp_path / "sc.json"
    main(["superclass", "derive", "--confusion", str(confusion_file), "-E", "3", "--out", str(out)])
    capsys.readouterr()
    listings = []
    for seed in ("0", "0", "5"):
        main(["superclass", "show", str(out), "--seed", seed])
        listings.append(capsys.readouterr().out)
    assert listings[0] == listings[1] != listings[2]


def test_derive_from_run_soft_and_hard(run_dir, tmp_path):
    soft, hard = tmp_path / "soft.json", tmp_path / "hard.json"
    base = ["superclass", "derive", "--run", str(run_dir), "--data", "digits", "-E", "3", "--device", "cpu"]
    assert main([*base, "--out", str(soft), "--plot", str(tmp_path / "soft.png")]) == 0
    assert main([*base, "--hard", "--method", "balanced", "--out", str(hard)]) == 0
    soft_classes, hard_classes = load(soft), load(hard)
    assert soft_classes.class_names == [str(d) for d in range(10)]
    assert soft_classes.source.endswith("split:val soft") and hard_classes.source.endswith("split:val hard")
    assert hard_classes.quality["size_max"] - hard_classes.quality["size_min"] <= 1


def test_derive_from_run_refuses_a_typod_device(run_dir):
    with pytest.raises(UsageError) as refused:
        confusion_from_run(run_dir, "digits", device="cuda0")
    assert str(refused.value) == "device 'cuda0': choose auto, cpu or cuda"  # one line, as every --device says it


def test_demo_helper(run_dir, tmp_path):
    lines = []
    result = derive_for_demo(run_dir, 3, tmp_path / "sc.json", echo=lines.append)
    assert load(tmp_path / "sc.json") == result
    assert "10 classes -> 3 super-classes" in lines[0]


def bad_inputs(tmp_path, confusion_file):
    non_square = tmp_path / "non_square.npy"
    np.save(non_square, np.ones((3, 4)))
    negative = tmp_path / "negative.csv"
    negative.write_text("1,-1\n0,1\n")
    nan = tmp_path / "nan.csv"
    nan.write_text("1,nan\n0,1\n")
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"\x00garbage")
    names = tmp_path / "names.txt"
    names.write_text("a\nb\n")
    conf = ["--confusion", str(confusion_file)]
    return {
        "non-square": (["--confusion", str(non_square), "-E", "2"], "square"),
        "negative": (["--confusion", str(negative), "-E", "2"], "negative"),
        "nan": (["--confusion", str(nan), "-E", "2"], "NaN"),
        "empty": (["--confusion", str(empty), "-E", "2"], "empty"),
        "unreadable": (["--confusion", str(garbage), "-E", "2"], "cannot read"),
        "missing": (["--confusion", str(tmp_path / "nope.npy"), "-E", "2"], "does not exist"),
        "E<2": ([*conf, "-E", "1"], "at least 2"),
        "E>C": ([*conf, "-E", "61"], "between 2 and 60"),
        "names": ([*conf, "-E", "3", "--class-names", str(names)], "2 class names for a 60-class"),
        "plot": ([*conf, "-E", "3", "--plot", str(tmp_path / "x.bmp")], "--plot"),
        "hard with file": ([*conf, "-E", "3", "--hard"], "--run only"),
        "both sources": ([*conf, "--run", str(tmp_path), "-E", "3"], "not allowed with"),
        "not a run": (["--run", str(tmp_path), "-E", "3"], "not a run directory"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "non-square",
        "negative",
        "nan",
        "empty",
        "unreadable",
        "missing",
        "E<2",
        "E>C",
        "names",
        "plot",
        "hard with file",
        "both sources",
        "not a run",
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_file(tmp_path, confusion_file, capsys, case):
    args, message = bad_inputs(tmp_path, confusion_file)[case]
    out = tmp_path / "out" / "sc.json"
    assert main(["superclass", "derive", *args, "--out", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and message in error
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # not even a temp file


def test_run_with_mismatched_data_is_refused(run_dir, tmp_path, capsys):
    out = tmp_path / "sc.json"
    args = ["superclass", "derive", "--run", str(run_dir), "--data", "synthetic", "-E", "3", "--out", str(out)]
    assert main(args) == 2
    assert "that are not the 10 of the run" in capsys.readouterr().err
    assert not out.exists()


def test_an_out_over_a_file_the_command_reads_is_refused_before_any_work(run_dir, confusion_file, capsys):
    weights, matrix = (run_dir / "best.pt").read_bytes(), confusion_file.read_bytes()
    for source, target in ((run_dir, run_dir / "best.pt"), (confusion_file, confusion_file)):
        flag = "--run" if source == run_dir else "--confusion"
        assert main(["superclass", "derive", flag, str(source), "-E", "3", "--out", str(target)]) == 2
        assert "which this command reads" in capsys.readouterr().err
    assert (run_dir / "best.pt").read_bytes() == weights and confusion_file.read_bytes() == matrix


def test_outputs_replace_only_files_of_their_own_kind(run_dir, confusion_file, tmp_path, capsys):
    """derive's --out and evaluate's --confusion replace an earlier output of theirs, never another file; a .csv
    confusion is written as CSV with its class names, and derive reads it back."""
    foreign = tmp_path / "config.json"
    foreign.write_text('{"a run": "config"}')
    derive = ["superclass", "derive", "--confusion", str(confusion_file), "-E", "3", "--out"]
    assert main([*derive, str(foreign)]) == 2
    assert "exists and is not a super-class file" in capsys.readouterr().err and "a run" in foreign.read_text()
    assert main([*derive, str(tmp_path / "sc.txt")]) == 2 and "give a .json name" in capsys.readouterr().err
    assert main([*derive, str(tmp_path / "sc.json")]) == main([*derive, str(tmp_path / "sc.json")]) == 0  # replaced
    picture = tmp_path / "holiday.png"  # a PNG of another program's: --plot does not replace it
    picture.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    assert main([*derive, str(tmp_path / "sc.json"), "--plot", str(picture)]) == 2
    assert "--plot" in capsys.readouterr().err and picture.read_bytes().endswith(b"\x00" * 64)
    loop = tmp_path / "loop.png"
    loop.symlink_to(loop)  # a symbolic-link loop: no file behind it, so the figure takes its place
    assert main([*derive, str(tmp_path / "sc.json"), "--plot", str(loop)]) == 0
    read_figure(loop)
    photo = tmp_path / "photo.csv"
    photo.write_text("not,a\nconfusion,matrix\n")
    assert main(["evaluate", str(run_dir), "--confusion", str(photo)]) == 2
    assert "exists and is not a confusion file" in capsys.readouterr().err and photo.read_text().startswith("not")
    counts = tmp_path / "counts.csv"
    assert main(["evaluate", str(run_dir), "--confusion", str(counts)]) == 0
    assert main(["evaluate", str(run_dir), "--confusion", str(counts)]) == 0  # its own output, replaced
    perfect = tmp_path / "perfect.npy"  # a confusion file with nothing to cluster is still one to replace
    save_confusion(perfect, np.eye(3) * 4, ["a", "b", "c"])
    check_confusion_output(perfect, "--confusion")
    assert counts.read_text().splitlines()[0] == ",".join(str(c) for c in range(10))  # digits' class names
    assert main(["superclass", "derive", "--confusion", str(counts), "-E", "3", "--out", str(tmp_path / "c.json")]) == 0
    assert load(tmp_path / "c.json").class_names == [str(c) for c in range(10)]


@pytest.mark.parametrize(
    "fault, message",
    [
        ("truncated", "holds fewer bytes than its header promises"),
        ("trailing bytes", "holds bytes after its array"),
        ("larger than memory allows", r"its header promises a \(10, 10\) array of 0.0 GiB, more than a quarter of"),
    ],
)
def test_a_confusion_npy_is_checked_before_it_is_read(fault, message, tmp_path, monkeypatch):
    from mobile_moe.formats import confusion
    from mobile_moe.utils import devices

    path = tmp_path / "c.npy"
    np.save(path, np.ones((10, 10)))
    if fault == "truncated":
        path.write_bytes(path.read_bytes()[:-8])
    elif fault == "trailing bytes":
        path.write_bytes(path.read_bytes() + b"\0" * 8)
    else:
        monkeypatch.setattr(devices, "memory_limit", lambda: 799)  # the 800 bytes of a (10, 10) float64 array
    with pytest.raises(UsageError, match=message):
        confusion.load_confusion(path)


def test_class_without_images_warns_and_names_it(tmp_path, capsys):
    matrix = planted_confusion(30, 3, noise=0.05, seed=1).confusion
    matrix[4] = 0.0
    path = tmp_path / "confusion.csv"
    np.savetxt(path, matrix, delimiter=",", header=",".join(f"kind{i}" for i in range(30)), comments="")
    out = tmp_path / "sc.json"
    assert main(["superclass", "derive", "--confusion", str(path), "-E", "3", "--out", str(out)]) == 0
    assert "no validation images for class 4 (kind4)" in capsys.readouterr().err
    assert json.loads(out.read_text())["quality"]["classes_without_images"] == [4]


def test_show_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["superclass", "show", str(bad)]) == 2
    assert "not a super-class file" in capsys.readouterr().err


@pytest.mark.parametrize("count", [2, 5, 10, 11, 20])
def test_every_super_class_up_to_twenty_gets_its_own_colour_and_neighbours_are_not_twins(count):
    """tab20 in index order gave super-classes 0 and 1 two blues (footwear read as coat / pullover): the palette
    keeps each colour distinct and no two neighbouring IDs a hue and its light twin."""
    import colorsys
    import itertools

    from mobile_moe.super_class.plot import super_class_colour

    colours = [super_class_colour(s, count)[:3] for s in range(count)]
    assert len(set(colours)) == count
    hues = [colorsys.rgb_to_hsv(*colour)[0] for colour in colours]
    for before, after in itertools.pairwise(hues):
        assert min(abs(before - after), 1 - abs(before - after)) > 0.02  # a different hue, not a lighter one
