"""The one way the toolkit writes a matplotlib figure: atomically, at 120 dpi, cropped to what is drawn
(`bbox_inches="tight"`: a long tick label or a legend outside the axes stays in the file, where `tight_layout` would
cut it), in the format the file's suffix names, every character one its font can draw, and its metadata naming
mobile-moe as its creator (`read_figure`: a command asked to write over an existing file replaces only a figure of
its own, never a user's image of the same name)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from mobile_moe.errors import UsageError
from mobile_moe.utils.atomic import atomic_path

CREATOR = "mobile-moe"
# Each format's metadata naming the creator (matplotlib's savefig `metadata`), and the signature and bytes it leaves
# in the file: PNG a tEXt chunk before the image data, PDF its Info dictionary, SVG a Dublin Core creator.
METADATA = {"png": {"Software": CREATOR}, "pdf": {"Creator": CREATOR}, "svg": {"Creator": CREATOR}}
MARKS = {
    "png": (b"\x89PNG\r\n\x1a\n", re.compile(re.escape(f"tEXtSoftware\x00{CREATOR}".encode()))),
    "pdf": (b"%PDF-", re.compile(re.escape(f"/Creator ({CREATOR})".encode()))),
    "svg": (b"", re.compile(rb"<dc:creator>\s*<cc:Agent>\s*<dc:title>" + CREATOR.encode() + rb"</dc:title>")),
}
FIGURE_BYTES = 64 * 2**20  # a figure of ours is far smaller: a larger file is read no further, and is not one


def save_figure(figure, path: str | os.PathLike) -> None:
    path = Path(path)
    _drawable_texts(figure)
    form = path.suffix.lower().removeprefix(".") or "png"
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format=form, dpi=120, bbox_inches="tight", metadata=METADATA.get(form))


def read_figure(path: str | os.PathLike) -> None:
    """UsageError unless `path` is a figure save_figure wrote: its format's signature and the metadata naming
    mobile-moe (atomic.check_replaceable's reader for figures)."""
    path = Path(path)
    signature, mark = MARKS.get(path.suffix.lower().removeprefix("."), (None, None))
    if signature is None or not path.is_file():  # a FIFO or a device would block the read, or never end
        raise UsageError(f"{path} is not a figure mobile-moe wrote")
    with open(path, "rb") as file:
        content = file.read(FIGURE_BYTES + 1)
    if not content.startswith(signature) or not mark.search(content[:FIGURE_BYTES]):
        raise UsageError(f"{path} is not a figure mobile-moe wrote")


def _drawable_texts(figure) -> None:
    """A character no font of its text draws (a CJK class name on a machine with only DejaVu Sans) is written as its
    code point, U+9774, in the figure itself: matplotlib would draw an empty box and warn "Glyph 38772 ... missing
    from font(s)" on stderr (matplotlib/_text_helpers.py:13, warn_on_missing_glyph) once per character. Tick labels
    given as a list (`set_xticks(ticks, labels)`) are drawn anew from their formatter (a FuncFormatter over them,
    matplotlib/axis.py `set_ticklabels`), so its output is changed too."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.text import Text
    from matplotlib.ticker import FixedFormatter, FuncFormatter

    for text in figure.findobj(Text):
        text.set_text(_drawable(text.get_text(), text.get_fontproperties()))
    for axes in figure.axes:
        for axis in (axes.xaxis, axes.yaxis):
            labels = axis.get_ticklabels()
            properties = labels[0].get_fontproperties() if labels else FontProperties()
            for formatter in (axis.get_major_formatter(), axis.get_minor_formatter()):
                if isinstance(formatter, FixedFormatter):
                    formatter.seq = [_drawable(str(label), properties) for label in formatter.seq]
                elif isinstance(formatter, FuncFormatter) and not getattr(formatter.func, "drawable", False):
                    formatter.func = _drawing(formatter.func, properties)


def _drawing(label, properties):
    """A FuncFormatter's function whose labels are drawable (marked, so a second save does not wrap it again)."""

    def drawable_label(value, position=None):
        return _drawable(str(label(value, position)), properties)

    drawable_label.drawable = True
    return drawable_label


def _drawable(content: str, properties) -> str:
    if content.isascii():
        return content
    from matplotlib.font_manager import fontManager, get_font

    # The fonts Agg draws `properties` with, fallbacks included (matplotlib/backends/backend_agg.py:308, _prepare_font)
    fonts = [get_font(path) for path in fontManager._find_fonts_by_props(properties)]
    return "".join(
        c if c.isspace() or any(font.get_char_index(ord(c)) for font in fonts) else f"U+{ord(c):04X}" for c in content
    )
