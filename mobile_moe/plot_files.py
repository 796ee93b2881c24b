"""The one way the toolkit writes a matplotlib figure: atomically, at 120 dpi, cropped to what is drawn
(`bbox_inches="tight"`: a long tick label or a legend outside the axes stays in the file, where `tight_layout` would
cut it), in the format the file's suffix names, every character one its font can draw."""

from __future__ import annotations

import os
from pathlib import Path

from mobile_moe.atomic import atomic_path


def save_figure(figure, path: str | os.PathLike) -> None:
    path = Path(path)
    _drawable_texts(figure)
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format=path.suffix.lower().removeprefix(".") or "png", dpi=120, bbox_inches="tight")


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
