"""Fault injection for super-classes and the demo: bad super-class files, bad `superclass derive|show` and `demo`
arguments. Every one exits with status 2 and ONE line on stderr (no traceback), writes nothing, never hangs on a FIFO;
and derive never writes NaN or Infinity into a super-class file."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from mobile_moe.app.cli import main
from mobile_moe.data.datasets import open_data
from mobile_moe.errors import UsageError
from mobile_moe.formats.superclasses import SuperClasses, load
from mobile_moe.models.registry import make_config
from mobile_moe.super_class.planted import planted_confusion
from mobile_moe.super_class.quality import quality, within_share
from mobile_moe.training.demo import train_digits
from mobile_moe.training.super_spec import resolve_super_classes

GOOD = {
    "version": 1,
    "num_super_classes": 3,
    "assignment": [0, 1, 2, 0, 1, 2],
    "class_names": ["a", "b", "c", "d", "e", "f"],
    "names": ["x", "y", "z"],
    "method": "spectral",
    "source": "test",
    "quality": {
        "within_confusion_share": 0.5,
        "chance_share": 0.2,
        "sizes": [2, 2, 2],
        "size_min": 2,
        "size_max": 2,
        "balance": 1.0,
        "classes_without_images": [],
    },  # fmt: skip
}


def _with(**changes) -> str:
    return json.dumps({**GOOD, **changes})


def _quality(**changes) -> str:
    return _with(quality={**GOOD["quality"], **changes})


def _raw(old: str, new: str) -> str:
    text = json.dumps(GOOD)
    assert old in text
    return text.replace(old, new, 1)


# name -> (file text or bytes, fragment of the one-line message)
BAD_FILES: dict[str, tuple[str | bytes, str]] = {
    "assignment null": (_with(assignment=None), "assignment"),
    "class_names null": (_with(class_names=None), "class_names"),
    "names [null]": (_with(names=[None, "y", "z"]), "names.0"),
    "num_super_classes null": (_with(num_super_classes=None), "num_super_classes"),
    "method null": (_with(method=None), "method"),
    "source null": (_with(source=None), "source"),
    "num_super_classes string": (_with(num_super_classes="3"), "num_super_classes"),
    "num_super_classes float": (_with(num_super_classes=3.0), "num_super_classes"),
    "num_super_classes bool": (_with(num_super_classes=True), "num_super_classes"),
    "num_super_classes mismatch": (_with(num_super_classes=4), "names"),
    "one super-class": (_with(num_super_classes=1, names=["x"], assignment=[0] * 6), "num_super_classes"),
    "more super-classes than classes": (
        _with(num_super_classes=7, names=list("abcdefg"), assignment=[0, 1, 2, 3, 4, 5]),
        "at most one per class",
    ),
    "assignment floats": (_with(assignment=[0.0, 1.0, 2.0, 0.0, 1.0, 2.0]), "assignment.0"),
    "assignment bools": (_with(assignment=[0, True, 2, 0, 1, 2]), "assignment.1"),
    "assignment string": (_with(assignment="012012"), "assignment"),
    "assignment nested": (_with(assignment=[[0], 1, 2, 0, 1, 2]), "assignment.0"),
    "index out of range": (_with(assignment=[0, 1, 2, 0, 1, 5]), "outside 0..2"),
    "negative index": (_with(assignment=[0, 1, 2, 0, 1, -1]), "assignment.5"),
    "unused index": (_with(assignment=[0, 1, 0, 0, 1, 1]), "[2] have no classes"),
    "class_names short": (_with(class_names=["a", "b"]), "2 class names for 6 classes"),
    "class_names ints": (_with(class_names=[1, 2, 3, 4, 5, 6]), "class_names.0"),
    "names too many": (_with(names=["x", "y", "z", "w"]), "4 names"),
    # text printed by show, copied by train into a run and by export into a manifest: no forged lines or colours
    "name with an escape code": (_with(names=["a\x1b[31mRED", "y", "z"]), "names.0"),
    "name with a newline": (_with(names=["x", "b\nc", "z"]), "control character"),
    "source sets the terminal title": (_with(source="x\x1b]0;pwned\x07"), "source"),
    "method with a newline": (_with(method="spectral\nEVIL"), "method"),
    "class name with a tab": (_with(class_names=["a", "b\tc", "c", "d", "e", "f"]), "control character"),
    "class names twice": (_with(class_names=["a", "a", "c", "d", "e", "f"]), "more than once"),
    "quality list": (_with(quality=[1, 2]), "quality"),
    "quality share string": (_quality(within_confusion_share="x"), "quality.within_confusion_share"),
    "quality share above 1": (_quality(balance=2.0), "quality.balance"),
    "quality sizes length": (_quality(sizes=[6]), "quality.sizes"),
    "quality unknown class": (_quality(classes_without_images=[99]), "classes_without_images"),
    "NaN": (_raw('"num_super_classes": 3', '"num_super_classes": NaN'), "NaN"),
    "NaN in quality": (_raw('"balance": 1.0', '"balance": NaN'), "NaN"),
    "Infinity": (_raw('"balance": 1.0', '"balance": Infinity'), "Infinity"),
    "5000-digit integer": (_raw('"num_super_classes": 3', '"num_super_classes": ' + "9" * 5000), "not valid JSON"),
    "4000-digit integer": (_raw('"num_super_classes": 3', '"num_super_classes": ' + "9" * 4000), "num_super_classes"),
    "nested 50000 deep": ("[" * 50000 + "]" * 50000, "nested too deeply"),
    "top-level list": ("[1, 2]", "not a super-class file"),
    "missing keys": ("{}", "not a super-class file"),
    "truncated": (_with()[:-10], "not valid JSON"),
    "empty": ("", "not valid JSON"),
    "binary garbage": (b"\xff\xfe\x00\x01garbage", "cannot read"),
    # a file of another format version, or of none (written before versions): one line that says so, before any rule
    "no version": (json.dumps({k: v for k, v in GOOD.items() if k != "version"}), "is a super-class file of format "
                   "version 0 (it states none); this mobile-moe reads "
                   "version 1: derive it again (mobile-moe superclass derive)"),  # fmt: skip
    "version 0": (_with(version=0), "is a super-class file of format version 0; this mobile-moe reads version 1"),
    "version 2": (_with(version=2), "of format version 2 (written by a newer mobile-moe); this mobile-moe reads "
                                    "version 1: upgrade mobile-moe, or derive it again"),  # fmt: skip
    "version string": (_with(version="1"), 'states format version "1", not an integer'),
    "version of another file's rules": (_with(version=0, class_names=None), "of format version 0"),
}


def _write(path, content: str | bytes):
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(autouse=True)
def no_hang():
    """A FIFO read would block forever: turn that into a failure after 30 s instead."""

    def fail(signum, frame):
        raise AssertionError("blocked (opened a FIFO?)")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_good_file_loads(tmp_path):
    loaded = load(_write(tmp_path / "sc.json", _with()))
    assert loaded.assignment == GOOD["assignment"] and loaded.quality == GOOD["quality"]
    loaded.save(tmp_path / "saved.json")  # the writer states the format version first
    assert list(json.loads((tmp_path / "saved.json").read_text()).items())[0] == ("version", 1)


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_super_class_file_is_one_line(tmp_path, capsys, case):
    content, fragment = BAD_FILES[case]
    path = _write(tmp_path / "sc.json", content)
    line = _one_line_error(capsys, ["superclass", "show", str(path)])
    assert fragment in line and str(path) in line
    with pytest.raises(UsageError) as caught:  # the loader training uses: the same refusal
        load(path)
    assert len(str(caught.value).splitlines()) == 1 and fragment in str(caught.value)


@pytest.mark.parametrize(
    "case", ["assignment null", "unused index", "NaN", "nested 50000 deep", "class_names short", "no version"]
)
def test_training_refuses_bad_super_class_file(tmp_path, case):
    path = _write(tmp_path / "sc.json", BAD_FILES[case][0])
    config = make_config("mobile-vmoe", "4x64", patch_size=8, image_size=32, num_classes=10, num_experts=3)
    with pytest.raises(UsageError) as caught:
        resolve_super_classes(str(path), open_data("digits", 32), config)
    assert len(str(caught.value).splitlines()) == 1 and BAD_FILES[case][1] in str(caught.value)


def test_super_classes_built_in_code_follow_the_file_rules():
    with pytest.raises(UsageError, match="have no classes"):
        SuperClasses([0, 0, 1], ["a", "b", "c"], ["x", "y", "z"], "test", "test")
    with pytest.raises(UsageError, match="quality.balance"):
        SuperClasses([0, 1], ["a", "b"], ["x", "y"], "test", "test", {"balance": float("nan")})
    assert SuperClasses(list(np.array([0, 1])), ["a", "b"], ["x", "y"], "t", "t").assignment == [0, 1]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Files for the bad-argument table: one good 12-class confusion and many bad ones."""
    root = tmp_path_factory.mktemp("inputs")
    good = planted_confusion(12, 3, noise=0.1, seed=0).confusion
    np.save(root / "good.npy", good)
    np.save(root / "complex.npy", good.astype(complex))
    np.save(root / "strings.npy", good.astype(str))
    np.save(root / "cube.npy", np.ones((2, 2, 2)))
    np.save(root / "non_square.npy", np.ones((3, 4)))
    np.save(root / "diagonal.npy", np.eye(4))
    (root / "garbage.npy").write_bytes(b"\x93NUMPY garbage")
    (root / "empty.csv").write_text("")
    (root / "header_only.csv").write_text("a,b\n")
    (root / "nan.csv").write_text("1,nan\n0,1\n")
    (root / "inf.csv").write_text("1,inf\n0,1\n")
    (root / "negative.csv").write_text("1,-1\n0,1\n")
    (root / "dir.npy").mkdir()
    (root / "dir.png").mkdir()
    os.mkfifo(root / "fifo.npy")
    os.mkfifo(root / "fifo.json")
    os.mkfifo(root / "fifo.txt")
    (root / "deep.json").write_text("[" * 50000 + "]" * 50000)
    (root / "not_list.json").write_text('{"a": 1}')
    (root / "sc.json").write_text(_with())
    (root / "file").write_text("x")
    (root / "semicolons.csv").write_text("1;2\n3;4\n")
    (root / "twice.csv").write_text("crane,dog,crane\n5,1,1\n1,5,1\n1,1,5\n")  # ImageNet names "crane" twice
    (root / "huge_field.csv").write_text('"' + "9" * 200_000 + '"\n')  # over the csv module's field limit
    (root / "o.png").symlink_to(root / "o.json")  # a plot name that is the --out file under another name
    return root


def _derive(root, *args: str, out: str | None = None) -> list[str]:
    return ["superclass", "derive", *args, "--out", out if out is not None else str(root / "out" / "sc.json")]


def _with_class_names(name: str):
    """derive from good.npy with --class-names r/NAME (a file the case sets up)."""
    return lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "3", "--class-names", str(r / name))


# name -> (argv builder, message fragment)
BAD_ARGS = {
    "confusion missing": (lambda r: _derive(r, "--confusion", str(r / "nope.npy"), "-E", "3"), "does not exist"),
    "confusion directory": (lambda r: _derive(r, "--confusion", str(r / "dir.npy"), "-E", "3"), "not a regular file"),
    "confusion FIFO": (lambda r: _derive(r, "--confusion", str(r / "fifo.npy"), "-E", "3"), "not a regular file"),
    "confusion empty": (lambda r: _derive(r, "--confusion", str(r / "empty.csv"), "-E", "2"), "empty"),
    "confusion field too large": (
        lambda r: _derive(r, "--confusion", str(r / "huge_field.csv"), "-E", "2"), "field larger than field limit"
    ),
    "confusion semicolons": (
        lambda r: _derive(r, "--confusion", str(r / "semicolons.csv"), "-E", "2"), "separates its values with commas"
    ),
    "confusion header names a class twice": (
        lambda r: _derive(r, "--confusion", str(r / "twice.csv"), "-E", "2"),
        "twice.csv: header: class name 'crane' appears more than once; rename it there, or give --class-names FILE",
    ),
    "confusion header only": (lambda r: _derive(r, "--confusion", str(r / "header_only.csv"), "-E", "2"), "read"),
    "confusion garbage": (lambda r: _derive(r, "--confusion", str(r / "garbage.npy"), "-E", "2"), "cannot read"),
    "confusion complex": (lambda r: _derive(r, "--confusion", str(r / "complex.npy"), "-E", "3"), "real numbers"),
    "confusion strings": (lambda r: _derive(r, "--confusion", str(r / "strings.npy"), "-E", "3"), "real numbers"),
    "confusion 3-D": (lambda r: _derive(r, "--confusion", str(r / "cube.npy"), "-E", "2"), "2-D"),
    "confusion non-square": (lambda r: _derive(r, "--confusion", str(r / "non_square.npy"), "-E", "2"), "square"),
    "confusion NaN": (lambda r: _derive(r, "--confusion", str(r / "nan.csv"), "-E", "2"), "NaN"),
    "confusion Inf": (lambda r: _derive(r, "--confusion", str(r / "inf.csv"), "-E", "2"), "infinite"),
    "confusion negative": (lambda r: _derive(r, "--confusion", str(r / "negative.csv"), "-E", "2"), "negative"),
    "confusion diagonal": (lambda r: _derive(r, "--confusion", str(r / "diagonal.npy"), "-E", "2"), "off-diagonal"),
    "E 0": (lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "0"), "at least 2"),
    "E -1": (lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "-1"), "at least 2"),
    "E > C": (lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "13"), "between 2 and 12"),
    "E not a number": (lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "x"), "invalid int"),
    "seed -1": (lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "3", "--seed", "-1"), "--seed -1"),
    "seed 2**32": (lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "3", "--seed", str(2**32)), "seed"),
    "batch size 0": (lambda r: _derive(r, "--run", str(r), "-E", "3", "--batch-size", "0"), "--batch-size 0"),
    "run FIFO": (lambda r: _derive(r, "--run", str(r / "fifo.json"), "-E", "3"), "run directory"),
    "run is a file": (lambda r: _derive(r, "--run", str(r / "file"), "-E", "3"), "run directory"),
    "out unwritable": (
        lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "3", out="/proc/x/super.json"),
        "cannot write /proc/x/super.json",
    ),
    "out is a directory": (
        lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "3", out=str(r / "dir.npy")),
        "is a directory",
    ),
    "out empty": (lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "3", out=""), "--out is empty"),
    "plot unwritable": (
        lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "3", "--plot", "/proc/x/p.png"),
        "cannot write /proc/x/p.png",
    ),
    "plot is a directory": (
        lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "3", "--plot", str(r / "dir.png")),
        "is a directory",
    ),
    "plot empty": (lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "3", "--plot", ""), "--plot"),
    "plot is out": (
        lambda r: _derive(
            r, "--confusion", str(r / "good.npy"), "-E", "3", "--plot", str(r / "o.png"), out=str(r / "o.json")
        ),
        "different names",
    ),
    "plot format": (lambda r: _derive(r, "--confusion", str(r / "good.npy"), "-E", "3", "--plot", "p.bmp"), ".png"),
    "class names FIFO": (_with_class_names("fifo.txt"), "not a regular file"),
    "class names missing": (_with_class_names("nope.txt"), "does not exist"),
    "class names directory": (_with_class_names("dir.npy"), "not a regular file"),
    "class names deep JSON": (_with_class_names("deep.json"), "nested too deeply"),
    "class names not a list": (_with_class_names("not_list.json"), "list of strings"),
    "class names count": (_with_class_names("sc.json"), "list of strings"),
    "show examples -2": (lambda r: ["superclass", "show", str(r / "sc.json"), "--examples", "-2"], "--examples -2"),
    "show FIFO": (lambda r: ["superclass", "show", str(r / "fifo.json")], "not a regular file"),
    "show directory": (lambda r: ["superclass", "show", str(r)], "not a regular file"),
    "show missing": (lambda r: ["superclass", "show", str(r / "nope.json")], "does not exist"),
    "demo epochs 0": (lambda r: ["demo", "--epochs", "0", "--out", str(r / "demo")], "--epochs 0"),
    "demo epochs -1": (lambda r: ["demo", "--epochs", "-1", "--out", str(r / "demo")], "--epochs -1"),
    "demo out unwritable": (lambda r: ["demo", "--out", "/proc/x"], "cannot write /proc/x"),
    "demo out is a file": (lambda r: ["demo", "--out", str(r / "file")], "not a directory"),
    "demo out empty": (lambda r: ["demo", "--out", ""], "--out is empty"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_arguments_are_one_line_and_write_nothing(inputs, capsys, case):
    build, fragment = BAD_ARGS[case]
    before = sorted(p.name for p in inputs.iterdir())
    line = _one_line_error(capsys, build(inputs))
    assert fragment in line
    assert sorted(p.name for p in inputs.iterdir()) == before  # no output, no temporary, no demo directory


def _finite_json(path) -> dict:
    def refuse(name):
        raise AssertionError(f"{name} in {path}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_derive_never_writes_non_finite_json(tmp_path, capsys):
    confusion = planted_confusion(12, 3, noise=0.1, seed=0).confusion
    huge = confusion / confusion.max() * 1.7e308  # every entry finite, their sums overflow float64
    zero_row = confusion.copy()
    zero_row[2] = 0.0
    for name, matrix in {"huge": huge, "zero_row": zero_row}.items():
        np.save(tmp_path / f"{name}.npy", matrix)
        out = tmp_path / f"{name}.json"
        args = ["superclass", "derive", "--confusion", str(tmp_path / f"{name}.npy"), "-E", "3", "--out", str(out)]
        assert main(args) == 0
        written = _finite_json(out)["quality"]
        assert 0 < written["within_confusion_share"] <= 1 and 0 < written["chance_share"] < 1
    assert "Traceback" not in capsys.readouterr().err


def test_undefined_quality_is_null_not_nan(tmp_path):
    assert within_share(np.eye(3), np.array([0, 1, 1])) is None
    measured = quality(np.eye(3), [0, 1, 1])
    assert measured["within_confusion_share"] is None and measured["within_affinity_share"] is None
    SuperClasses([0, 1, 1], ["a", "b", "c"], ["x", "y"], "test", "test", measured).save(tmp_path / "sc.json")
    assert _finite_json(tmp_path / "sc.json")["quality"]["within_confusion_share"] is None
    assert load(tmp_path / "sc.json").quality == measured


def test_show_prints_undefined_quality_as_na(tmp_path, capsys):
    measured = quality(np.eye(3), [0, 1, 1])
    SuperClasses([0, 1, 1], ["a", "b", "c"], ["x", "y"], "test", "test", measured).save(tmp_path / "sc.json")
    assert main(["superclass", "show", str(tmp_path / "sc.json")]) == 0
    assert "confusion inside super-classes: n/a" in capsys.readouterr().out


def test_demo_epochs_zero_is_refused_not_the_default():
    with pytest.raises(UsageError, match="at least 1"):
        train_digits("dense", "unused", epochs=0)
