"""`mobile-moe predict` runs an ExecuTorch bundle in libmobile_moe, as an app does: with ExecuTorch's Python runtime
unimportable it still answers, and its answers are the C API's own (mm_predict_rgb8 on the same decoded pixels), bit
for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_build
from PIL import Image

pytestmark = [pytest.mark.export, needs_build]
DRIVER = Path(__file__).parents[1] / "device_bench" / "c_api.py"

# predict in a process where ExecuTorch's Python runtime (its pybindings, and the runtime module over them) cannot be
# imported: a toolkit that still ran bundles through it would fail here.
WITHOUT_EXECUTORCH_RUNTIME = """
import importlib.abc, sys

class Unimportable(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("executorch.runtime", "executorch.extension.pybindings")):
            raise ImportError(f"{name} is made unimportable by the test")
        return None

sys.meta_path.insert(0, Unimportable())
from mobile_moe.app.cli import main
sys.exit(main(sys.argv[1:]))
"""


def photos(folder: Path) -> list[Path]:
    """Images as apps meet them: a large JPEG, a small PNG with a stride of odd width, a grey PNG."""
    generator = np.random.default_rng(4)
    folder.mkdir()
    shapes = {"large.jpg": (375, 500, 3), "odd.png": (31, 45, 3), "grey.png": (40, 40)}
    paths = []
    for name, shape in shapes.items():
        pixels = (generator.random(shape) * 255).astype(np.uint8)
        paths.append(folder / name)
        Image.fromarray(pixels).save(paths[-1])
    return paths


def test_predict_answers_without_executorchs_python_runtime_as_the_c_api_does(bundle, tmp_path, runner):
    from mobile_moe.data.image_files import read_image
    from mobile_moe.library.build import build_library

    paths = photos(tmp_path / "photos")
    command = [sys.executable, "-c", WITHOUT_EXECUTORCH_RUNTIME, "predict", str(bundle), *map(str, paths), "--json",
               "--logits"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    predicted = json.loads(result.stdout)
    pixels = {path.name: np.asarray(read_image(path, "RGB")) for path in paths}
    np.savez(tmp_path / "pixels.npz", **pixels)
    subprocess.run([sys.executable, str(DRIVER), "--preprocess", str(build_library()), str(bundle),
                    str(tmp_path / "pixels.npz")], check=True, capture_output=True, timeout=300)  # fmt: skip
    c_api = np.load(tmp_path / "pixels.out.npz")
    for record, path in zip(predicted, paths, strict=True):
        assert np.array_equal(np.asarray(record["logits"], dtype=np.float32), c_api[f"{path.name}.logits"])
        assert record["class_index"] == int(np.argmax(c_api[f"{path.name}.logits"]))


def test_predict_where_the_library_cannot_be_built_says_so_in_one_line(bundle, tmp_path):
    """No compiler or CMake on PATH and no build cached: one line naming what to install, exit status 2."""
    env = {"PATH": str(tmp_path / "empty"), "MOBILE_MOE_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    image = photos(tmp_path / "p")[0]
    result = subprocess.run([sys.executable, "-m", "mobile_moe", "predict", str(bundle), str(image)],
                            capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "cannot build libmobile_moe" in result.stderr
    assert "cmake and a C++ compiler" in result.stderr and "install them" in result.stderr
