"""Image files -> PIL images: ONE decoder, for training's imagefolder datasets (mobile_moe/data/folders.py) and
predict (mobile_moe/export/images.py), so a missing, special, damaged or oversized file reads the same in both: one line
naming it. Every image is read as a viewer shows it: 16-bit as 8-bit, a photo with an EXIF orientation upright.

PIL's decompression-bomb limit stays on: such a file is reported, not decoded; PIL's warnings never reach stderr.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator

from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from mobile_moe.errors import UsageError


class UnreadableImage(UsageError):
    """An image file that cannot be decoded (one line from a DataLoader worker too: UsageError's constructor)."""


def read_image(path: str | os.PathLike, mode: str = "RGB") -> Image.Image:
    """The image at `path`, converted to `mode` ("RGB", or "L" for one channel); UnreadableImage if it cannot be.
    The default mode makes it torchvision's pil_loader, as ImageFolder's `loader`; ImageFolder decodes lazily, so
    mobile_moe/data/image_check.py decodes every file of a folder with it before the work starts."""
    if not os.path.exists(path):
        raise UnreadableImage(f"image {path} does not exist")
    if not os.path.isfile(path):  # a directory, a FIFO (opening it would wait forever) or a device
        raise UnreadableImage(f"image {path} is not a regular file (PNG or JPEG expected)")
    return _decoded(path, f"image {path}", mode)


def image_from_bytes(data: bytes, name: str, mode: str = "RGB") -> Image.Image:
    """An encoded image held in memory (a packed store's: store.py), read as read_image reads a file; `name` says
    which image it is in the one line of an UnreadableImage."""
    return _decoded(io.BytesIO(data), name, mode)


def eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit grey image (PIL's "I;16" modes, or "I" from a 16-bit PNG) as its 8-bit equivalent, the high byte of
    each pixel: PIL's own convert clips such values at 255, so a 16-bit PNG would read as nearly white."""
    if not image.mode.startswith("I"):
        return image
    import numpy as np

    pixels = np.clip(np.asarray(image).astype(np.int64), 0, 65535) >> 8
    return Image.fromarray(pixels.astype(np.uint8), mode="L")


@contextlib.contextmanager
def pil_quiet() -> Iterator[None]:
    """PIL's warnings off stderr (a damaged EXIF block: "Corrupt EXIF data"; it reads what it can), but for the
    decompression-bomb warning, raised: PIL warns between its pixel limit and twice it and refuses beyond, and both
    are the same one line here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        yield


def exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation tag of an opened image (1, upright, when it has none): read from its header, no pixels."""
    return image.getexif().get(ExifTags.Base.Orientation, 1)


def upright(image: Image.Image) -> Image.Image:
    """The image as a viewer shows it: a camera's photo stored sideways with an EXIF orientation tag (2 to 8) turned
    upright (PIL's exif_transpose); any other image as it is."""
    return ImageOps.exif_transpose(image) if exif_orientation(image) != 1 else image


def stored_upright(data: bytes) -> bool:
    """Whether encoded image `data` needs no turning (its EXIF orientation, read from the header alone, is 1 or
    absent); False where the header cannot be read, so that the one decoder reads it and says what is wrong."""
    try:
        with pil_quiet(), Image.open(io.BytesIO(data)) as image:
            return exif_orientation(image) == 1
    except Exception:  # noqa: BLE001 (any failure: the decoder, which reports it, decides)
        return False


def _decoded(source, name: str, mode: str) -> Image.Image:
    try:
        with pil_quiet():
            with Image.open(source) as image:
                image = upright(image)
                if image.mode == "P" and "transparency" in image.info:
                    image = image.convert("RGBA")  # PIL's advice for palette transparency, which it warns about
                return eight_bit(image).convert(mode)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise UnreadableImage(f"{name} is too large to decode safely ({error}); shrink it first") from None
    except UnidentifiedImageError:
        raise UnreadableImage(f"cannot read {name}: not an image PIL can decode (PNG or JPEG expected)") from None
    except (OSError, SyntaxError, ValueError) as error:  # PIL's errors for truncated or damaged files
        reason = " ".join(str(error).split())[:200]
        raise UnreadableImage(f"cannot read {name}: {reason or type(error).__name__}") from None
