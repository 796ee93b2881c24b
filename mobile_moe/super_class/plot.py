"""Picture of a super-class division: the confusion graph coloured by super-class, and the confusion matrix with
classes reordered by super-class (strong blocks on the diagonal = confusion kept inside super-classes)."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and phones' build hosts

import matplotlib.pyplot as plt  # noqa: E402
import networkx as nx  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from mobile_moe.errors import UsageError  # noqa: E402
from mobile_moe.formats.superclasses import SuperClasses  # noqa: E402
from mobile_moe.super_class.graph import class_affinity, knn_sparsify  # noqa: E402
from mobile_moe.utils.plot_files import save_figure  # noqa: E402

FORMATS = (".png", ".pdf", ".svg")


def check_plot_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise UsageError(f"--plot {path}: give a {', '.join(FORMATS)} file")
    return path


def draw_graph(axis, confusion: np.ndarray, super_classes: SuperClasses, seed: int = 0) -> None:
    """Each class linked to its 3 strongest confusions (all edges would be a hairball at 1000 classes)."""
    affinity = knn_sparsify(class_affinity(confusion), min(3, confusion.shape[0] - 1))
    graph = nx.from_numpy_array(affinity)
    positions = nx.spring_layout(graph, weight="weight", seed=seed, iterations=50)
    colours = [super_class_colour(s, super_classes.num_super_classes) for s in super_classes.assignment]
    size = max(4.0, 300.0 / np.sqrt(confusion.shape[0]))
    nx.draw_networkx_edges(graph, positions, ax=axis, alpha=0.2, width=0.5)
    nx.draw_networkx_nodes(graph, positions, ax=axis, node_color=colours, node_size=size, linewidths=0)
    if confusion.shape[0] <= 40:
        labels = dict(enumerate(super_classes.class_names))
        nx.draw_networkx_labels(graph, positions, labels=labels, ax=axis, font_size=7)
    axis.set_title(f"confusion graph, coloured by super-class (E={super_classes.num_super_classes})")
    axis.axis("off")
    legend_of_colours(axis, super_classes)


LEGEND_ENTRIES = 20  # tab20's colours: past 20 super-classes they repeat, and a legend would not say which is which
# tab20 pairs each hue with its light twin (blue, light blue, orange, ...): in index order, super-classes 0 and 1
# would be two blues. Its 10 strong hues first, then their light twins, keeps neighbouring IDs apart.
TAB20_APART = [*range(0, 20, 2), *range(1, 20, 2)]


def super_class_colour(super_class: int, count: int):
    """Super-class `super_class`'s colour of `count`: tab10's qualitative hues up to 10, tab20's (hues first) past."""
    if count <= 10:
        return plt.get_cmap("tab10")(super_class)
    return plt.get_cmap("tab20")(TAB20_APART[super_class % 20])


def legend_of_colours(axis, super_classes: SuperClasses) -> None:
    """Which colour is which super-class: its ID, name and size (the first 20; colours repeat after that)."""
    shown = min(super_classes.num_super_classes, LEGEND_ENTRIES)
    handles = [
        Line2D([], [], marker="o", linestyle="", color=super_class_colour(s, super_classes.num_super_classes),
               label=f"{s}: {super_classes.names[s]} ({len(super_classes.members(s))})")
        for s in range(shown)
    ]  # fmt: skip
    title = "super-class (classes)" + ("" if shown == super_classes.num_super_classes else f", first {shown}")
    axis.legend(handles=handles, title=title, loc="upper left", bbox_to_anchor=(0, 0), ncol=min(shown, 4),
                fontsize=7, title_fontsize=7, frameon=False)  # fmt: skip


def draw_heatmap(axis, confusion: np.ndarray, super_classes: SuperClasses) -> None:
    """Row-normalised confusion rates (diagonal hidden), log-scaled, classes grouped by super-class."""
    assignment = np.asarray(super_classes.assignment)
    order = np.argsort(assignment, kind="stable")
    rates = confusion / np.maximum(confusion.sum(1, keepdims=True), 1e-12)
    np.fill_diagonal(rates, np.nan)
    image = axis.imshow(np.log10(rates[np.ix_(order, order)] + 1e-4), cmap="magma", interpolation="nearest")
    for boundary in np.cumsum(np.bincount(assignment))[:-1]:
        axis.axhline(boundary - 0.5, color="cyan", linewidth=0.6)
        axis.axvline(boundary - 0.5, color="cyan", linewidth=0.6)
    if len(order) <= 40:  # name the (reordered) classes; beyond that the ticks only mark positions
        names = [super_classes.class_names[c] for c in order]
        axis.set_xticks(range(len(order)), names, rotation=90, fontsize=7)
        axis.set_yticks(range(len(order)), names, fontsize=7)
    axis.set_title("confusion rate, classes grouped by super-class")
    axis.set_xlabel("predicted class")
    axis.set_ylabel("true class")
    plt.colorbar(image, ax=axis, fraction=0.046, label="log10 rate")


def plot_super_classes(path: str | os.PathLike, confusion: np.ndarray, super_classes: SuperClasses) -> None:
    """Write the two panels side by side to `path` (.png, .pdf or .svg), atomically."""
    path = check_plot_path(path)
    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 6.5))
    try:
        draw_graph(left, confusion, super_classes)
        draw_heatmap(right, confusion, super_classes)
        save_figure(figure, path)
    finally:
        plt.close(figure)
