"""save_figure (mobile_moe/utils/plot_files.py): every figure the toolkit writes draws each character with its font, or
writes the character's code point where no installed font has it, without matplotlib's glyph warnings."""

from __future__ import annotations

import os
import warnings

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from mobile_moe.errors import UsageError  # noqa: E402
from mobile_moe.utils.plot_files import read_figure, save_figure  # noqa: E402


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_characters_no_font_draws_are_written_as_code_points_without_a_warning(tmp_path, suffix):
    path = tmp_path / f"plot{suffix}"
    # DejaVu Sans alone (matplotlib ships it; it has no CJK glyphs), whatever fonts this machine has installed
    with matplotlib.rc_context({"font.family": ["DejaVu Sans"]}):
        figure, axes = plt.subplots()
        try:
            axes.set_xticks([0, 1], ["靴 shoes", "Ärmel, été"])
            axes.plot([0, 1], [0, 1], label="束")
            axes.legend()
            axes.set_title("groups of 模型")
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # "Glyph 38772 ... missing from font(s)" would raise here
                save_figure(figure, path)
        finally:
            plt.close(figure)
    assert [label.get_text() for label in axes.get_xticklabels()] == ["U+9774 shoes", "Ärmel, été"]
    assert axes.get_title() == "groups of U+6A21U+578B"
    assert [text.get_text() for text in axes.get_legend().get_texts()] == ["U+675F"]
    assert path.stat().st_size > 0


@pytest.mark.parametrize("suffix", [".png", ".pdf", ".svg"])
def test_a_figure_names_mobile_moe_as_its_creator_and_only_such_a_figure_is_ours(tmp_path, suffix):
    """read_figure, the reader --plot's replacement check uses: our own figure of each format, not another program's
    (matplotlib's own metadata), a truncated one, one under another format's suffix, or a renamed text file."""
    ours, theirs = tmp_path / f"ours{suffix}", tmp_path / f"theirs{suffix}"
    figure, axes = plt.subplots()
    try:
        axes.plot([0, 1], [0, 1])
        save_figure(figure, ours)
        # another program's figure: matplotlib's own creator, and the toolkit's name only as the title
        figure.savefig(theirs, format=suffix[1:], metadata={"Title": "mobile-moe"})
    finally:
        plt.close(figure)
    read_figure(ours)
    renamed = tmp_path / ("ours.svg" if suffix != ".svg" else "ours.png")
    renamed.write_bytes(ours.read_bytes())
    truncated = tmp_path / f"truncated{suffix}"
    truncated.write_bytes(ours.read_bytes()[:40])  # before the mark, in each format
    text = tmp_path / f"notes{suffix}"
    text.write_text("mobile-moe")
    fifo = tmp_path / f"fifo{suffix}"
    os.mkfifo(fifo)  # never opened: it would block the read
    for other in (theirs, renamed, truncated, text, fifo):
        with pytest.raises(UsageError, match="not a figure mobile-moe wrote"):
            read_figure(other)
