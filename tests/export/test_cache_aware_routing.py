"""Cache-aware routing (arXiv 2412.00099): a loaded expert within a gate margin of the top one is taken instead.

The rule is mobile_moe/export/bundle_routing.py's pick_experts (its own cases, and its C++ translation's agreement, are
in tests/device_bench/test_bundle_routing.py); here the same images, hence the same gates, go through predict, the
Python bundle runtime and the native runner.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import needs_build
from PIL import Image

from mobile_moe.app.cli import main
from mobile_moe.device_bench.native_runner import run_native
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.errors import UsageError
from mobile_moe.export.images import load_image
from mobile_moe.export.manifest import read_manifest
from mobile_moe.export.runtime import load_bundle

pytestmark = pytest.mark.export


def test_a_margin_outside_zero_to_one_is_refused(bundle):
    with pytest.raises(UsageError, match="cache_margin -0.1: out of range"):
        load_bundle(bundle, cache_margin=-0.1)
    with pytest.raises(UsageError, match="--cache-margin"):
        RoundSettings(cache_margin=2.0)


def _png_images(bundle, tmp_path, count: int = 8) -> list[str]:
    """PNG files of random content at the bundle's input size."""
    size = read_manifest(bundle).input.shape[-1]
    rng = np.random.default_rng(5)
    paths = []
    for index in range(count):
        path = tmp_path / f"image_{index}.png"
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def _python_sequence(bundle, images, margin: float) -> list[list[int]]:
    runtime = load_bundle(bundle, cache_experts=1, cache_margin=margin)
    return [runtime.predict(image).experts for image in images]


@needs_build
def test_predict_the_python_runtime_and_the_native_runner_route_alike(runner, bundle, tmp_path, capsys):
    """One expert cached; margin 0 routes as plain top-k, a margin taken from the images' own gates changes some of
    the routing (not all), and the three implementations choose the same experts for every image."""
    paths = _png_images(bundle, tmp_path)
    manifest = read_manifest(bundle)
    images = [load_image(path, manifest.input) for path in paths]
    raw = tmp_path / "images.f32"
    np.stack([image.numpy() for image in images]).astype(np.float32).tofile(raw)
    plain = _python_sequence(bundle, images, 0.0)
    gates = [load_bundle(bundle).predict(image).gates[0] for image in images]
    margin = float(np.median(np.abs(np.diff(gates)))) + 0.01
    for d in (0.0, margin):
        python = _python_sequence(bundle, images, d)
        native = run_native(runner, bundle, raw, RoundSettings(iterations=1, warmup=0, cache_experts=1,
                                                                cache_margin=d, switch_repeats=0))  # fmt: skip
        assert main(["predict", str(bundle), *paths, "--json", "--cache-experts", "1", "--cache-margin", repr(d)]) == 0
        predicted = json.loads(capsys.readouterr().out)
        assert [row["experts"] for row in native["images"]] == python == [row["experts"] for row in predicted]
        assert native["cache_margin"] == pytest.approx(d)
    unlimited = load_bundle(bundle, cache_experts=0)  # every expert stays loaded: plain top-k
    assert plain == [unlimited.predict(image).experts for image in images]
    cache_aware = _python_sequence(bundle, images, margin)
    assert cache_aware != plain, "precondition: the margin should change some routing"
    changes = sum(a != b for a, b in zip(cache_aware, cache_aware[1:], strict=False))
    assert changes < sum(a != b for a, b in zip(plain, plain[1:], strict=False))
