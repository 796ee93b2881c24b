"""Which input pipeline a run takes (mobile_moe/data/inputs.py), and the eval geometry the device pipeline shows
when a recipe does not crop at random."""

from __future__ import annotations

import numpy as np
import pytest

from mobile_moe import preprocess
from mobile_moe.data import inputs
from mobile_moe.data.augment import INPUT_PIPELINES
from mobile_moe.training import recipes


@pytest.mark.parametrize(
    ("choice", "recipe", "expected"),
    [
        ("auto", "deit", "crop"),  # 2 CPU cores: 1.5-2x the per-image path (benchmarks/input_host_cost.py)
        ("auto", "tiny", "workers"),  # nothing drawn at random: the images are computed once
        ("device", "tiny", "device"),
        ("workers", "deit", "workers"),
    ],
)
def test_auto_resolves_by_recipe_and_a_choice_stays(choice, recipe, expected):
    aug = recipes.recipe(recipe).augmentation
    assert inputs.resolve(choice, aug) == expected
    assert expected in INPUT_PIPELINES


def test_the_eval_geometry_is_the_region_the_eval_resize_shows():
    sizes = np.array([[375, 500], [64, 32]])
    stretch = inputs.eval_crops(sizes, preprocess.stretch(), 32)
    assert stretch.tolist() == [[0, 0, 375, 500], [0, 0, 64, 32]]
    centre = inputs.eval_crops(sizes, preprocess.resize_center_crop(224), 224)  # shorter side to 256, centre 224
    side = 375 * 224 / 256
    assert np.allclose(centre[0], [(375 - side) / 2, (500 - side) / 2, side, side])
