"""The POSIX locale (LANG=C, LC_ALL=C) with non-ASCII paths and class names: the documented flow, from an image folder
to a bundle's prediction and the native runner's bench (train, superclass derive and show, evaluate, export, predict,
bench), completes, and every name comes back as it was written.

Python itself copes (PEP 538 coerces the C locale to C.UTF-8, PEP 540 turns on UTF-8 mode): what is checked is every
process the flow starts, matplotlib's labels, the native runner's paths and the JSON and CSV the toolkit writes.

Slow set: seven CLI processes (seconds each, for torch's import alone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_build
from PIL import Image

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["Ärmel", "t-shirt, été", "靴 \"shoes\""]  # accents, a comma and quotes, CJK and a space


def posix_locale() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("LC_", "PYTHONUTF8", "PYTHONIO"))}
    return {**env, "LANG": "C", "LC_ALL": "C"}


def cli(*args: object) -> subprocess.CompletedProcess:
    """Run a command in the POSIX locale: it succeeds, and says nothing of glyphs, encodings or tracebacks."""
    result = subprocess.run([sys.executable, "-m", "mobile_moe", *map(str, args)], cwd=REPO, env=posix_locale(),
                            capture_output=True, text=True, encoding="utf-8", timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert not any(word in result.stderr for word in ("Warning", "Glyph", "Traceback", "codec")), result.stderr
    return result


def image_folder(root: Path) -> Path:
    """train/ and val/ with a folder per class of small random PNGs, each class its own mean colour."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("val", 8)):
        for index, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for n in range(count):
                pixels = rng.integers(0, 80, (32, 32, 3)) + 80 * index
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"bild-{n}-ü.png")
    return root


@needs_build
def test_the_flow_under_the_posix_locale_with_non_ascii_names(tmp_path):
    home = tmp_path / "données 模型"
    data = image_folder(home / "bilder")
    run, bundle, bench = home / "läufe" / "dicht", home / "束 bündel", home / "messung"
    cli("train", "--model", "vit", "--size", "2x32", "--patch", "8", "--image-size", "32", "--num-classes", 3,
        "--pool", "mean", "--data", f"imagefolder:{data}", "--recipe", "tiny", "--epochs", 1, "--out", run)  # fmt: skip
    cli("superclass", "derive", "--run", run, "--num-super-classes", 2, "--out", home / "gruppen.json",
        "--plot", home / "gruppen.png")  # fmt: skip
    groups = json.loads((home / "gruppen.json").read_text(encoding="utf-8"))
    assert groups["class_names"] == sorted(CLASSES), groups  # the class folders' names, sorted
    assert (home / "gruppen.png").stat().st_size > 0
    shown = cli("superclass", "show", home / "gruppen.json").stdout
    assert all(name in shown for name in CLASSES), shown
    evaluated = json.loads(cli("evaluate", run, "--json").stdout)
    assert 0 <= evaluated["top1"] <= 1, evaluated
    cli("export", run, "--format", "executorch", "--out", bundle)
    image = data / "val" / CLASSES[2] / "bild-0-ü.png"
    predicted = json.loads(cli("predict", bundle, image, "--json").stdout)
    assert predicted[0]["image"] == str(image) and predicted[0]["class"] in CLASSES
    cli("bench", bundle, "--runtime", "native", "--iterations", 2, "--warmup", 1, "--out", bench)
    runs = json.loads((bench / "results.json").read_text(encoding="utf-8"))["runs"]
    assert [run["bundle"] for run in runs] == [str(bundle)] and bundle.name in (bench / "report.md").read_text("utf-8")
