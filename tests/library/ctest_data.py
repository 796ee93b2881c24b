"""The library's own test data (libmobile_moe/tests/data/), which CTest runs the C tests on with no
Python: conftest's tiny Mobile V-MoE (E=4, k=1) exported as an ExecuTorch bundle, and 8 images it sends to every
expert (raw float32, N x 3 x 32 x 32). Written by `python tests/library/ctest_data.py` (again after a change of the
bundle format); test_ctest.py holds the committed files to the model they were exported from."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS.parent / "libmobile_moe" / "tests" / "data"
BUNDLE, IMAGES = DATA / "tiny-bundle", DATA / "images.f32"


def images():
    from conftest import bundle_images

    return bundle_images(8)


def main() -> None:
    sys.path.insert(0, str(TESTS))
    from conftest import bundle_images, bundle_model

    from mobile_moe.export.bundle import export_bundle

    DATA.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(BUNDLE, ignore_errors=True)
    export_bundle(bundle_model(), BUNDLE, "executorch", sample_images=bundle_images(6), mean=[0.5] * 3, std=[0.25] * 3)
    images().numpy().astype("float32").tofile(IMAGES)


if __name__ == "__main__":
    main()
