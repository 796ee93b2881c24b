"""The demo's super-class step: derive super-classes from the demo's dense run and print them like Table 1."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from mobile_moe.formats.superclasses import SuperClasses
from mobile_moe.super_class.derive import derive_super_classes
from mobile_moe.super_class.table import format_table


def derive_for_demo(
    run_dir: str | os.PathLike,
    num_super_classes: int,
    out: str | os.PathLike,
    data_spec: str | None = None,
    plot: str | os.PathLike | None = None,
    method: str = "spectral",
    seed: int = 0,
    echo: Callable[[str], None] = print,
) -> SuperClasses:
    """Soft confusion of `run_dir`'s best checkpoint on the val split -> E super-classes, saved to `out` (and a plot).

    Prints the Table-1-style listing through `echo`; returns the SuperClasses (train with `--super-classes out`).
    """
    # Reading a run is training's, the stage below this one.
    from mobile_moe.training.evaluate import confusion_from_run

    confusion = confusion_from_run(run_dir, data_spec, split="val", device="cpu")
    super_classes = derive_super_classes(
        confusion.matrix, num_super_classes, method, seed, confusion.class_names, confusion.source
    )
    super_classes.save(out)
    if plot is not None:
        from mobile_moe.super_class.plot import plot_super_classes  # matplotlib: only with a plot

        plot_super_classes(plot, confusion.matrix, super_classes)
    echo(format_table(super_classes, seed=seed))
    echo(f"super-classes written to {Path(out)}" + (f", plot to {Path(plot)}" if plot else ""))
    return super_classes
