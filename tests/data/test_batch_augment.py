"""The batched augmentation (mobile_moe/data/batch_augment.py) against torchvision's per-image pipeline: the same laws
for every draw (two-sample Kolmogorov-Smirnov and binomial bounds at about 1e-3 false alarms, seeds fixed), the
geometry of torchvision's own operations composed, its colour kernels on each group, and reproducibility."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from photos import photographs
from scipy import stats
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from mobile_moe.data import batch_augment as ba
from mobile_moe.data.augment import MAGNITUDE_BINS
from mobile_moe.training import recipes

N = 4000  # draws per law
P_FLOOR = 1e-3  # a KS p-value below this fails (1 in 1,000 for identical laws; the seeds are fixed)
SIZE = (375, 500)  # an ImageNet-sized source, (height, width)
S = 224
DEIT = recipes.deit().augmentation


def binomial_bound(p: float, n: int) -> float:
    return 4 * math.sqrt(p * (1 - p) / n)  # four standard deviations


def box(params: dict) -> list[int]:
    """RandomResizedCrop's params as our crop rows: top, left, height, width."""
    return [params["top"], params["left"], params["height"], params["width"]]


def ours(count=N, image_size=S, aug=DEIT, step=0, sizes=SIZE) -> ba.Draws:
    key = ba.StepKey(seed=0, epoch=0, rank=0, step=step)
    return ba.draw(aug, np.array([sizes] * count), image_size=image_size, key=key, eval_crop=None)


def test_crop_area_and_aspect_follow_random_resized_crop():
    torch.manual_seed(0)
    crop = v2.RandomResizedCrop(S, scale=(DEIT.crop_scale, 1.0))
    image = torch.zeros(3, *SIZE)
    theirs = np.array([box(crop.make_params([image])) for _ in range(N)])
    mine = ours().crop
    area, log_aspect = (lambda c: c[:, 2] * c[:, 3]), (lambda c: np.log(c[:, 3] / c[:, 2]))
    for measure in (area, log_aspect, lambda c: c[:, 0], lambda c: c[:, 1]):
        assert stats.ks_2samp(measure(mine), measure(theirs)).pvalue > P_FLOOR
    assert (mine[:, 0] + mine[:, 2] <= SIZE[0]).all() and (mine[:, 1] + mine[:, 3] <= SIZE[1]).all()


@pytest.mark.parametrize("size", [(1, 1000), (1000, 1)])  # no attempt fits: the fallback
def test_the_central_fallback_is_torchvisions(size):
    torch.manual_seed(0)
    params = v2.RandomResizedCrop(S, scale=(DEIT.crop_scale, 1.0)).make_params([torch.zeros(3, *size)])
    assert ba.central_crops(np.array([size]))[0].tolist() == box(params)


def test_each_image_flips_with_probability_one_half():
    assert abs(ours().flip.mean() - 0.5) < binomial_bound(0.5, N)


def test_randaugment_ops_signs_and_magnitudes_are_torchvisions():
    draws = ours()
    ops, magnitudes = draws.ops.ravel(), draws.magnitudes.ravel()
    counts = np.bincount(ops, minlength=len(ba.OPS))
    assert stats.chisquare(counts).pvalue > P_FLOOR  # uniform over the 14 ops, with replacement
    space = v2.RandAugment._AUGMENTATION_SPACE
    for op, (name, _, signed, _) in enumerate(ba.OPS):
        table, their_signed = space[name]
        values = table(MAGNITUDE_BINS, S, S)
        expected = 0.0 if values is None else float(values[DEIT.randaugment_magnitude])
        drawn = magnitudes[ops == op]
        assert np.allclose(np.abs(drawn), abs(expected), atol=1e-6), name
        assert signed == their_signed
        if signed and expected:
            assert abs((drawn < 0).mean() - 0.5) < binomial_bound(0.5, len(drawn)), name


def test_erasing_rate_and_boxes_follow_random_erasing():
    torch.manual_seed(0)
    erasing = v2.RandomErasing(p=1.0, value=0)
    image = torch.zeros(3, S, S)
    theirs = np.array([[p["h"], p["w"]] for p in (erasing.make_params([image]) for _ in range(N))])
    boxes = ours().erase
    erased = boxes[:, 2] > 0
    assert abs(erased.mean() - DEIT.random_erasing) < binomial_bound(DEIT.random_erasing, N)
    assert stats.ks_2samp(boxes[erased, 2] * boxes[erased, 3], theirs[:, 0] * theirs[:, 1]).pvalue > P_FLOOR
    log_aspects = np.log(boxes[erased, 2] / boxes[erased, 3]), np.log(theirs[:, 0] / theirs[:, 1])
    assert stats.ks_2samp(*log_aspects).pvalue > P_FLOOR


def test_mixup_and_cutmix_are_picked_evenly_with_their_beta_lambdas():
    draws = [ours(count=1, step=step).mix for step in range(N)]
    kinds = np.array([kind for kind, _, _ in draws])
    assert abs((kinds == "mixup").mean() - 0.5) < binomial_bound(0.5, N)
    mixup = [lam for kind, lam, _ in draws if kind == "mixup"]
    assert stats.kstest(mixup, stats.beta(DEIT.mixup_alpha, DEIT.mixup_alpha).cdf).pvalue > P_FLOOR
    torch.manual_seed(0)
    cutmix = v2.CutMix(alpha=DEIT.cutmix_alpha, num_classes=10)
    theirs = [cutmix.make_params([torch.zeros(2, 3, S, S)])["lam_adjusted"] for _ in range(N)]
    assert stats.ks_2samp([lam for kind, lam, _ in draws if kind == "cutmix"], theirs).pvalue > P_FLOOR


def test_draws_are_a_function_of_the_step_key_alone():
    first, again, other = ours(count=8), ours(count=8), ours(count=8, step=1)
    assert np.array_equal(first.crop, again.crop) and np.array_equal(first.ops, again.ops)
    assert not np.array_equal(first.crop, other.crop)


def smooth_image(height=90, width=120, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, 12, 16, generator=generator) * 255
    return F.resize(coarse, [height, width], antialias=False).round().clamp(0, 255).to(torch.uint8)


GEOMETRIC = [("Identity", 0.0), ("ShearX", 0.09), ("ShearY", -0.09), ("TranslateX", -19.5), ("TranslateY", 19.5),
             ("Rotate", 9.0), ("Rotate", -9.0)]  # fmt: skip


def torchvision_geometry(image, crop, flip, name, magnitude, size):
    """The per-image pipeline's geometry, op by op, with bilinear resampling throughout."""
    out = F.resized_crop(image.float(), *crop, [size, size], antialias=False)
    out = F.horizontal_flip(out) if flip else out
    bilinear = {"interpolation": F.InterpolationMode.BILINEAR}
    if name in ("ShearX", "ShearY"):
        angle = math.degrees(math.atan(magnitude))
        shear = [angle, 0.0] if name == "ShearX" else [0.0, angle]
        out = F.affine(out, angle=0.0, translate=[0, 0], scale=1.0, shear=shear, center=[0, 0], **bilinear)
    elif name in ("TranslateX", "TranslateY"):
        shift = [int(magnitude), 0] if name == "TranslateX" else [0, int(magnitude)]
        out = F.affine(out, angle=0.0, translate=shift, scale=1.0, shear=[0.0, 0.0], **bilinear)
    elif name == "Rotate":
        out = F.rotate(out, angle=magnitude, **bilinear)
    return out / 255


def ours_in_one_resample(image, crop, flip, ops: list[tuple[str, float]], size: int) -> torch.Tensor:
    names, magnitudes = np.array([[ba.OP_NAMES.index(name) for name, _ in ops]]), np.array([[m for _, m in ops]])
    frames = ba.randaugment_geometry(names, magnitudes, size)
    to_source = ba.crop_and_flip(np.array([crop], dtype=float), np.array([flip]), size) @ frames[:, 0]
    height, width = image.shape[-2:]
    matrices = [torch.tensor(m, dtype=torch.float32) for m in (to_source, frames)]
    return ba.resample(image, torch.tensor([[height, width]]), *matrices, size, 1)


@pytest.mark.parametrize(("first", "second"), [(("TranslateX", 10.0), ("TranslateX", -10.0)),
                                               (("Rotate", 30.0), ("Rotate", -30.0))])  # fmt: skip
def test_fill_from_an_earlier_op_stays_black_when_a_later_op_moves_it_back(first, second):
    """torchvision fills at each op: what the first op left black, the second moves into view black."""
    size = 32
    image = smooth_image(32, 32).clamp(min=1)  # no black of its own
    mine = ours_in_one_resample(image, (0, 0, 32, 32), False, [first, second], size)
    theirs = image.float()
    for name, magnitude in (first, second):
        theirs = torchvision_geometry(theirs, (0, 0, 32, 32), False, name, magnitude, size) * 255
    black_theirs, black_mine = theirs.eq(0).all(1), mine.eq(0).all(1)
    assert black_theirs.sum() > 0 and (black_mine == black_theirs).float().mean() > 0.97


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize(("name", "magnitude"), GEOMETRIC)
def test_one_resample_equals_torchvisions_operations_in_turn(name, magnitude, flip):
    """Crop, flip and a RandAugment op composed into one map: torchvision's pixels inside the frame (its bilinear fill
    blends the edge with black, a seam left out here), but for its second interpolation of a shear or rotation."""
    size, crop = 64, (10, 20, 70, 80)
    image = smooth_image()
    mine = ours_in_one_resample(image, crop, flip, [(name, magnitude)], size)
    difference = (mine - torchvision_geometry(image, crop, flip, name, magnitude, size)).abs()
    frame = torchvision_geometry(torch.full_like(image, 255), crop, flip, name, magnitude, size)  # 1 in, 0 filled
    inside = frame == 1
    assert inside.float().mean() > 0.5 and (mine[frame == 0] == 0).all()
    assert difference[inside].mean() < 0.005 and difference[inside].max() < 0.06


COLOUR = [name for name, geometric, _, _ in ba.OPS if not geometric and name != "Identity"]


@pytest.mark.parametrize("name", COLOUR)
def test_each_colour_group_gets_randaugments_own_operation(name):
    """The images that drew an op in a slot, as one group through the kernel, get what RandAugment gives each."""
    images = torch.cat([smooth_image(32, 32, seed) for seed in range(6)]).float() / 255  # (6, 3, 32, 32)
    op = ba.OP_NAMES.index(name)
    ops = np.array([[op], [op], [0], [op], [op], [0]])
    magnitudes = np.where(ops == op, _signed(name, [1, -1, 0, 1, -1, 0]), 0.0)  # both signs: two groups
    grouped = images.clone()
    for group_name, magnitude, chosen in ba.colour_groups(ops, magnitudes):
        index = torch.as_tensor(chosen)
        grouped[index] = ba.colour_kernel(group_name, magnitude)(grouped[index])
    randaugment = v2.RandAugment()
    for index in range(6):
        expected = images[index]
        if ops[index, 0] == op:
            magnitude = float(magnitudes[index, 0])
            expected = randaugment._apply_image_or_video_transform(expected, name, magnitude, "nearest", fill={})
        torch.testing.assert_close(grouped[index], expected, rtol=0, atol=1e-6)


def _signed(name: str, signs: list[int]) -> np.ndarray:
    """(B, 1) the op's magnitude at bin 9, times each sign where the op is signed."""
    _, _, signed, value = ba.OPS[ba.OP_NAMES.index(name)]
    base = value(9, 32)
    return np.array([[base * (sign if signed else abs(sign))] for sign in signs])


def test_a_batch_is_the_same_every_time_and_normalised():
    aug = ba.BatchAugment(image_size=32, mean=(0.5, 0.4, 0.3), std=(0.2, 0.2, 0.2), num_classes=5,
                          device=torch.device("cpu"))  # fmt: skip
    canvas = torch.cat([smooth_image(60, 80, seed) for seed in range(4)])
    sizes, labels = torch.tensor([[60, 80]] * 4), torch.tensor([0, 1, 2, 3])
    draws = ba.draw(DEIT, sizes.numpy(), image_size=32, key=ba.StepKey(3, 1, 0, 7), eval_crop=None)
    first, targets = aug.apply(canvas, sizes, draws, labels)
    again, _ = aug.apply(canvas, sizes, draws, labels)
    assert first.shape == (4, 3, 32, 32) and torch.equal(first, again)
    assert torch.allclose(targets.sum(1), torch.ones(4)) and targets.shape == (4, 5)


def test_a_supersampled_downscale_is_an_antialiased_resize():
    """A photograph's crop downscaled about 2x: the device path's resample, at the supersampling its batch draws,
    against torchvision's antialiased resized_crop (its reference for RandomResizedCrop): above 37 dB, and at least
    7 dB closer than one bilinear sample per pixel, which aliases the photographs' fine detail (a resample that
    ignored its factor would fail here)."""
    for photo in photographs():
        image = F.pil_to_tensor(photo)[None]
        height, width = image.shape[-2:]
        side = min(height, width) - 20
        crop = np.array([[10.0, 10.0, side, side]])
        factor = ba.supersampling(crop, S)
        assert factor == 2
        to_source = torch.tensor(ba.crop_and_flip(crop, np.array([False]), S), dtype=torch.float32)
        expected = F.resized_crop(image.float() / 255, 10, 10, side, side, [S, S], antialias=True)
        sizes, identity = torch.tensor([[height, width]]), torch.eye(3)[None, None]
        single, supersampled = (ba.resample(image, sizes, to_source, identity, S, n) for n in (1, factor))
        assert psnr(supersampled, expected) > 37 and psnr(supersampled, expected) > psnr(single, expected) + 7


def psnr(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Peak signal to noise ratio of images in [0, 1], dB."""
    return float(-10 * torch.log10(((got - expected) ** 2).mean()))
