"""The one way the toolkit writes a matplotlib figure: atomically, at 120 dpi, cropped to what is drawn
(`bbox_inches="tight"`: a long tick label or a legend outside the axes stays in the file, where `tight_layout` would
cut it), in the format the file's suffix names."""

from __future__ import annotations

import os
from pathlib import Path

from mobile_moe.atomic import atomic_path


def save_figure(figure, path: str | os.PathLike) -> None:
    path = Path(path)
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format=path.suffix.lower().removeprefix(".") or "png", dpi=120, bbox_inches="tight")
