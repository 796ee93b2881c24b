"""Every data-spec form the README and docs/formats.md show opens, taken from the text itself: each optional part
left out and put in, its placeholders filled with small local data. A form the docs show and the parser refuses (as
`fashion-mnist,train=N` once was) fails here, whichever document shows it. And a spec refused says, in one line,
which part of it was wrong and ends with a spec that opens."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import write_imagefolder
from test_idx_data import PER_CLASS, balanced, write_set

from mobile_moe.app.cli import main
from mobile_moe.data import idx_files, store
from mobile_moe.data.datasets import open_data
from mobile_moe.data.spec_options import EXAMPLES, spec_forms
from mobile_moe.errors import UsageError

REPOSITORY = Path(__file__).resolve().parents[2]
NAMES = ("digits-pairs", "digits", "synthetic", "fashion-mnist", "idx", "cifar10", "cifar100", "imagefolder", "packed")
FORM = re.compile(rf"`((?:{'|'.join(re.escape(name) for name in NAMES)})(?:[\[:,][^`\s]*)?)`")
# Values for the documented KEY=PLACEHOLDER options: small, and valid together.
OPTION_VALUES = {"train": "100", "val": "100", "test": "100", "seed": "1", "classes": "4", "super": "2",
                 "per_class": "20", "noise": "0.1"}  # fmt: skip
SOME_OPTION = {"synthetic": "classes=4", "digits-pairs": "train=100"}  # a generic `k=v`: one of the dataset's own
NEEDS_ROOT = ("idx", "cifar10", "cifar100", "imagefolder", "packed")  # written alone, these are names, not forms
CIFAR_ABSENT = "no readable|holds"  # a CIFAR form that parsed reaches the reader, which finds no CIFAR files here


def documented_forms() -> list[str]:
    """The spec forms written in backticks in the data guide's and docs/formats.md's data sections."""
    guide = (REPOSITORY / "docs" / "data.md").read_text()
    formats = (REPOSITORY / "docs" / "formats.md").read_text()
    data_section = formats[formats.index("## 1. Data specs") : formats.index("\n## 2.")]
    guide_part = guide[guide.index("## Data specs") : guide.index("\n## ", guide.index("## Data specs") + 1)]
    found = {form for text in (guide_part, data_section) for form in FORM.findall(text)}
    return sorted(form for form in found if not (form in NEEDS_ROOT or form.endswith(":coarse")))  # --super-classes


def expansions(form: str) -> list[str]:
    """`form` with each [optional part] left out or put in, every combination."""
    parts = re.split(r"(\[[^\]]*\])", form)
    choices = [["", part[1:-1]] if part.startswith("[") else [part] for part in parts]
    return ["".join(chosen) for chosen in itertools.product(*choices)]


def filled(form: str, roots: dict[str, Path]) -> str:
    """Placeholders given values: KEY=VALUE options by key, `k=v,...` as one option, ROOT and STORE as local data."""
    name = re.match(r"[a-z0-9-]+", form).group()
    option = SOME_OPTION.get(name, "train=100")
    form = form.replace("k=v,...", option).replace("k=v", option)
    form = re.sub(r"(\w+)=[A-Z][\w]*", lambda m: f"{m.group(1)}={OPTION_VALUES[m.group(1)]}", form)
    return form.replace("ROOT", str(roots.get(name, "ROOT"))).replace("STORE", str(roots["packed"]))


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("specs")
    idx = write_set(base / "idx", {split: balanced(range(10), n) for split, n in PER_CLASS.items()})
    folder = write_imagefolder(base / "folder", {"train": 3, "val": 2}, ("a", "b"), (12, 10))
    packed = store.pack(open_data("digits", 8), base / "store", max_side=8)
    return {"fashion-mnist": idx, "idx": idx, "imagefolder": folder, "packed": packed, "cifar10": base / "no-cifar",
            "cifar100": base / "no-cifar"}  # fmt: skip


def test_the_documents_show_every_kind_of_spec():
    shown = {re.match(r"[a-z0-9-]+", form).group() for form in documented_forms()}
    assert shown == set(NAMES)


@pytest.mark.parametrize("form", documented_forms())
def test_every_documented_spec_form_opens(form, roots, monkeypatch):
    monkeypatch.setattr(idx_files, "FASHION_MNIST_ROOT", str(roots["fashion-mnist"]))  # the ROOT-less form's default
    for spec in (filled(variant, roots) for variant in expansions(form)):
        if spec.startswith("cifar"):
            with pytest.raises(UsageError, match=CIFAR_ABSENT):
                open_data(spec, 8)
            continue
        data = open_data(spec, 8)
        image, label = data.split("test")[0]
        assert image.shape == (3, 8, 8) and 0 <= label < data.num_classes and np.isfinite(image.numpy()).all()


def opens(spec: str, roots: dict[str, Path]) -> None:
    """`spec` (an example: /path/to/... standing for its name's folder) opens with local data in place of the folder;
    a CIFAR spec gets as far as reading the files, which this machine has none of."""
    name = re.match(r"[a-z0-9-]+", spec).group()
    spec = re.sub(r"/path/to/[^,]*", str(roots.get(name, "")), spec)
    if name.startswith("cifar"):
        with pytest.raises(UsageError, match=CIFAR_ABSENT):
            open_data(spec, 8)
        return
    assert open_data(spec, 8).num_classes >= 2


def test_every_name_of_the_grammar_has_an_example_that_opens(roots, monkeypatch):
    monkeypatch.setattr(idx_files, "FASHION_MNIST_ROOT", str(roots["fashion-mnist"]))
    assert set(EXAMPLES) == set(spec_forms()) == set(NAMES)
    for example in EXAMPLES.values():
        opens(example, roots)


# (spec, the words that must name its culprit part): each a case a reviewer found refused with the whole grammar, an
# example-less type error, an unnamed set or a repeated prefix.
REFUSALS = [
    ("digits:train=5", "digits takes no options, yet 'train=5' follows it"),
    ("cifar10", "no folder after 'cifar10:'"),
    ("cifar100:", "no folder after 'cifar100:'"),
    ("imagefolder", "no folder after 'imagefolder:'"),
    ("packed:", "no folder after 'packed:'"),
    ("mnist", "no data named 'mnist'; did you mean idx:ROOT[,k=v,...] or fashion-mnist"),
    ("Digits", "did you mean digits"),
    ("idx,train=5", "did you mean idx:ROOT"),
    ("digits-pairs,train=200", "options follow ':' after digits-pairs, not ','; write digits-pairs:train=200"),
    ("synthetic,classes=4", "options follow ':' after synthetic, not ','; write synthetic:classes=4"),
    ("fashion-mnist:train=abc", "fashion-mnist: train='abc' is not a valid int"),
    ("fashion-mnist,train=abc", "fashion-mnist: train='abc' is not a valid int"),
    ("synthetic:classes=x", "synthetic: classes='x' is not a valid int"),
    ("digits-pairs:test=many", "digits-pairs: test='many' is not a valid int"),
    ("synthetic:colour=3", "synthetic: unknown option 'colour'"),
    ("fashion-mnist:train=-1", "fashion-mnist: train=-1 must be an integer from 0"),
    ("synthetic:seed=-1", "synthetic: seed=-1 must be an integer from 0 to 4294967295"),
    ("digits-pairs:seed=4294967296", "digits-pairs: seed=4294967296 must be an integer from 0 to 4294967295"),
    ("synthetic:noise=nan", "synthetic: noise=nan must be a finite number from 0 up"),
    ("synthetic:noise=inf", "synthetic: noise=inf must be a finite number from 0 up"),
    ("synthetic:classes=4,classes=5", "synthetic: classes is given twice"),
    ("synthetic:classes=4,,super=2", "synthetic: an empty option"),
    ("synthetic:classes=100000", "synthetic: classes=100000 x per_class=100 images of 8 px need about"),
    ("synthetic:super=1", "synthetic: super=1 must be between 2"),
    ("digits-pairs:train=5", "digits-pairs: train=5 must be between 100"),
    ("fashion-mnist:train=5", "'fashion-mnist:train=5': train=5 is fewer images than the 10 classes"),
    ("idx::", "idx: no folder ':'"),
    ("idx", "idx: no folder;"),
    ("idx:a,b", "idx: 2 folders ('a', 'b')"),
]


@pytest.mark.parametrize("spec, culprit", REFUSALS)
def test_a_refused_spec_names_the_part_and_ends_with_one_that_opens(spec, culprit, roots, monkeypatch, tmp_path):
    monkeypatch.setattr(idx_files, "FASHION_MNIST_ROOT", str(roots["fashion-mnist"]))
    monkeypatch.chdir(tmp_path)  # relative folders (idx::, idx:a,b) are none
    with pytest.raises(UsageError) as refused:
        open_data(spec, 8)
    message = str(refused.value)
    assert culprit in message and "\n" not in message and "use digits |" not in message
    assert not re.search(r"(\b[\w-]+: )\1|(\w+=\w+): \2", message)  # no repeated prefix ("train=5: train=5:")
    example = re.search(r"(?:e\.g\. --data|; write) (\S+)$", message)
    assert example, f"no example at the end of: {message}"
    opens(example.group(1), roots)


@pytest.mark.parametrize("spec", ["digits:train=5", "mnist", "digits-pairs,train=200", "synthetic:classes=x"])
def test_the_cli_prints_a_refused_spec_in_one_line_and_writes_nothing(spec, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "vit", "--size", "2x32", "--patch", "8", "--image-size", "32", "--num-classes", "10"]
    assert main([*argv, "--recipe", "tiny", "--epochs", "1", "--data", spec, "--out", str(out), "--quiet"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and re.search(r"(e\.g\. --data|; write) \S+$", error)
    assert not out.exists()


@pytest.mark.parametrize("spec", ["digits", "digits-pairs:train=100,val=100,test=100"])
def test_images_resized_beyond_memory_are_refused_before_the_resize(spec):
    """Resized as asked, they would need terabytes: torch's allocator failed with a traceback (pack --max-side 3000,
    train --image-size 8000000000), or the kernel killed the process."""
    with pytest.raises(UsageError, match=r"of 100000 x 100000 pixels need .* GiB, more than .* choose a smaller image"):
        open_data(spec, 100_000)
