"""save_figure (mobile_moe/plot_files.py): every figure the toolkit writes draws each character with its font, or
writes the character's code point where no installed font has it, without matplotlib's glyph warnings."""

from __future__ import annotations

import warnings

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from mobile_moe.plot_files import save_figure  # noqa: E402


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
