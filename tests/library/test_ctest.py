"""libmobile_moe builds and tests alone: CTest runs its tests (tests/library_faults.c's scenarios, the example app,
the runner, the Java binding's tests/java/JavaBindingTest.java) on its own test data, with no Python; the data is a
real export of conftest's tiny model."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch
from conftest import bundle_model, needs_build
from ctest_data import BUNDLE, IMAGES, images

pytestmark = [pytest.mark.export, needs_build]


def test_ctest_passes_in_the_librarys_own_build(runner):
    build = runner.parent / "cmake-build"
    result = subprocess.run(["ctest", "--test-dir", str(build), "--output-on-failure", "-j", "2"],
                            capture_output=True, text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    assert "100% tests passed" in result.stdout and "library_faults.shared-handle-results" in result.stdout
    if shutil.which("javac"):  # the Java binding's test, where the build found a JDK
        assert "java_binding" in result.stdout


def test_the_librarys_test_data_is_the_tiny_model_exported(runner):
    from mobile_moe.library.binding import Model

    stored = np.fromfile(IMAGES, dtype=np.float32).reshape(-1, 3, 32, 32)
    # the seeded draw, up to ATen's normal sampler, whose last bit follows the CPU's vector kernels
    np.testing.assert_allclose(stored, images().numpy(), atol=1e-5)
    with torch.no_grad():
        eager = bundle_model()(torch.from_numpy(stored))
    model = Model(BUNDLE, weight_cache_dir="")
    for image, logits, experts in zip(stored, eager.logits, eager.routing.experts, strict=True):
        prediction = model.predict(image)
        np.testing.assert_allclose(prediction.logits, logits.numpy(), atol=1e-5, rtol=1e-4)
        assert prediction.experts == experts.tolist()
    assert len({int(e[0]) for e in eager.routing.experts}) == 4  # the images reach every expert
