"""A folder of real photographs as a new user has one: ROOT/train/<class>/ and ROOT/val/<class>/, sorted by class.

Each class is one region of one of the three photographs installed here (scikit-learn's china.jpg and flower.jpg,
matplotlib's grace_hopper.jpg), each image a jittered 500x375 crop of it; among the JPEGs are progressive, grayscale,
PNG, EXIF-rotated and 3000x2000 files, as a phone's and a camera's folder mixes them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

SIZE = (500, 375)


def photographs() -> list[Image.Image]:
    from matplotlib import cbook
    from sklearn.datasets import load_sample_image

    hopper = Image.open(cbook.get_sample_data("grace_hopper.jpg")).convert("RGB")
    return [Image.fromarray(load_sample_image(name)) for name in ("china.jpg", "flower.jpg")] + [hopper]


def _save(image: Image.Image, path: Path, kind: int) -> None:
    """Every 7th image progressive, every 11th grayscale, every 13th PNG, every 17th EXIF-rotated (stored on its
    side, tagged to be turned upright), every 29th 3000x2000; the rest baseline JPEG."""
    if kind % 29 == 28:
        image.resize((3000, 2000)).save(path.with_suffix(".jpg"), quality=90)
    elif kind % 17 == 16:
        exif = Image.Exif()
        exif[0x0112] = 6  # Orientation: rotate 90 clockwise to view
        image.transpose(Image.Transpose.ROTATE_90).save(path.with_suffix(".jpg"), quality=90, exif=exif)
    elif kind % 13 == 12:
        image.save(path.with_suffix(".png"))
    elif kind % 11 == 10:
        image.convert("L").save(path.with_suffix(".jpg"), quality=90)
    else:
        image.save(path.with_suffix(".jpg"), quality=90, progressive=kind % 7 == 6)


def write_photo_folder(root: Path, classes: int = 10, train: int = 30, val: int = 20, seed: int = 0) -> Path:
    """`classes` classes of `train` + `val` crops each (val/ becomes validation and test, half each)."""
    rng = np.random.default_rng(seed)
    sources = photographs()
    for label in range(classes):
        source = sources[label % len(sources)]
        width, height = source.size
        centre = np.array([width, height]) * (0.25 + 0.5 * rng.random(2))  # the class's region of its photo
        for index in range(train + val):
            split, number = ("train", index) if index < train else ("val", index - train)
            folder = root / split / f"class-{label}"
            folder.mkdir(parents=True, exist_ok=True)
            half = np.array([width, height]) * (0.18 + 0.06 * rng.random()) / 2
            middle = np.clip(centre + rng.normal(0, 12, 2), half, np.array([width, height]) - half)
            box = (*(middle - half), *(middle + half))
            _save(source.resize(SIZE, box=tuple(float(v) for v in box)), folder / f"{number:03d}", label * 50 + index)
    return root
