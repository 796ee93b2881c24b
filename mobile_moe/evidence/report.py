"""DIR/FIGURE.md (the paper's layout, its ImageNet numbers beside ours), DIR/FIGURE.csv (a row per cell) and
DIR/FIGURE.png (accuracy vs FLOPs like Fig. 1, or the ablation's bars); with --bench also DIR/FIGURE-latency.png."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mobile_moe.evidence.figures import ROUTING_OF_ROW, Figure
from mobile_moe.evidence.results import CellResult
from mobile_moe.utils.atomic import atomic_files
from mobile_moe.utils.plot_files import save_figure
from mobile_moe.utils.words import counted


@dataclass
class Setting:
    """What the numbers were measured on, for the table's caption."""

    data: str
    scale: str
    seeds: int
    epochs: str  # e.g. "20" or "20/30" where cells differ
    split: str

    @property
    def trained_for(self) -> str:
        """'1 epoch', '20 epochs', '20/30 epochs'."""
        return f"{self.epochs} epoch" + ("" if self.epochs == "1" else "s")


def pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def ours(result: CellResult, key: str = "top1") -> str:
    """'72.31 ± 0.40' (top-1 in %, std over seeds); in the top-1 column, why there is no number."""
    mean = pct(result.mean(key))
    if mean is None:
        return result.status if key == "top1" and result.status != "ok" else "-"
    std = pct(result.std(key))
    return f"{mean:.2f}" + ("" if std is None else f" ± {std:.2f}")


def delta(result: CellResult, by_name: dict[str, CellResult]) -> float | None:
    """Top-1 of the cell minus its dense baseline's, in points (means over seeds)."""
    base = by_name.get(result.cell.baseline) if result.cell.baseline else None
    mine, theirs = result.mean("top1"), base.mean("top1") if base else None
    return None if mine is None or theirs is None else 100 * (mine - theirs)


def signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def number(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def bench_columns(result: CellResult) -> list[str]:
    bench = result.bench
    if not bench:
        return ["-", "-", "-"]
    return [f"{bench['p50_ms']:.3f}", f"{bench['peak_rss_bytes'] / 2**20:.1f}",
            f"{bench['bytes_loaded_per_image'] / 1e3:.0f}"]  # fmt: skip


BENCH_HEADER = ["p50 ms", "peak RSS MiB", "KB loaded / image"]


# --- the tables -----------------------------------------------------------------------------------------------------


def _pairs_table(fig: Figure, results: list[CellResult], bench: bool) -> list[list[str]]:
    by_name = {r.cell.name: r for r in results}
    key = "k" if fig.name == "fig3d" else "model (paper)"
    header = [key, "ours", "MFLOPs paper", "MFLOPs ours", "dense paper", "dense ours", "MoE paper",
              "MoE ours", "Δ paper", "Δ ours"]  # fmt: skip
    header += [f"dense / MoE {h}" for h in BENCH_HEADER] if bench else []
    rows = [header]
    for moe in (r for r in results if r.cell.role == "moe"):
        dense = by_name[moe.cell.baseline]
        flops = moe.costs.get("flops")
        row = [moe.cell.row, moe.cell.backbone.size, number(moe.cell.paper.get("mflops"), "d"),
               number(flops / 1e6 if flops else None, ".1f"), number(dense.cell.paper.get("top1")), ours(dense),
               number(moe.cell.paper.get("top1")), ours(moe), signed(moe.cell.paper.get("delta")),
               signed(delta(moe, by_name))]  # fmt: skip
        if bench:
            row += [f"{a} / {b}" for a, b in zip(bench_columns(dense), bench_columns(moe), strict=True)]
        rows.append(row)
    return rows


def _rows_table(fig: Figure, results: list[CellResult], bench: bool) -> list[list[str]]:
    by_name = {r.cell.name: r for r in results}
    strategies = fig.name == "fig3e"
    first = ["routing", "input"] if strategies else [fig.cells[1].row.split("=")[0]]
    router = [] if strategies else ["router paper", "router ours"]
    header = [*first, "ours", *router, "top-1 paper", "top-1 ours", "Δ paper", "Δ ours", "params active (max)",
              "experts run / image"]  # fmt: skip
    header += BENCH_HEADER if bench else []
    rows = [header]
    for result in results:
        cell = result.cell
        key = list(ROUTING_OF_ROW.get(cell.row, (cell.row, "-"))) if strategies else [cell.row]
        routed = [] if strategies else [number(cell.paper.get("router")), ours(result, "router_accuracy")
                                        if cell.role == "moe" else "-"]  # fmt: skip
        experts = result.mean("experts_per_image_mean")
        active = result.costs.get("params_active")
        row = [*key, cell.backbone.size, *routed, number(cell.paper.get("top1")), ours(result),
               signed(cell.paper.get("delta")), signed(delta(result, by_name)),
               number(active / 1e6 if active else None, ".3f") + ("M" if active else ""),
               number(experts)]  # fmt: skip
        rows.append(row + (bench_columns(result) if bench else []))
    return rows


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def table_rows(fig: Figure, results: list[CellResult], bench: bool) -> list[list[str]]:
    return (_pairs_table if fig.layout == "pairs" else _rows_table)(fig, results, bench)


def claims(fig: Figure, results: list[CellResult]) -> list[str]:
    """The paper's claim for the figure and what our numbers say about it, computed from the table."""
    by_name = {r.cell.name: r for r in results}
    moes = [r for r in results if r.cell.role == "moe" and delta(r, by_name) is not None]
    if not moes:
        return ["No MoE cell has both its number and its baseline's yet."]
    above = [r.cell.row for r in moes if delta(r, by_name) > 0]
    lines = [f"MoE above its dense baseline in {len(above)} of {len(moes)} rows ({', '.join(above) or 'none'})."]
    clear = [r.cell.row for r in moes if _beyond_noise(r, by_name) > 0]
    if len(results[0].seeds) > 1 or any(len(r.seeds) > 1 for r in moes):
        lines.append(f"Above by more than the two seed stds combined: {len(clear)} ({', '.join(clear) or 'none'}).")
    lines += _cautions(moes, by_name)
    if fig.name in ("fig1", "fig3a"):
        lines.append("Paper: the MoE beats the dense ViT at every one of the 12 sizes (+1.60 to +4.66).")
    elif fig.name in ("fig3b", "fig3c"):
        best = max(moes, key=lambda r: r.mean("top1")).cell.row
        paper_best = "E=10" if fig.name == "fig3b" else "L=2"
        lines.append(f"Best ours: {best}; paper's best: {paper_best}.")
    elif fig.name == "fig3d":
        lines.append("Paper: largest gain at k=1 and k=2; at k=5 and k=10 the matched dense model wins.")
    else:
        compared = [r for r in results if r.mean("top1") is not None and r.cell.name != fig.source]
        order = sorted(compared, key=lambda r: -r.mean("top1"))
        lines.append(f"Ours, best first: {', '.join(r.cell.row for r in order)}.")
        lines.append("Paper, best first: e2e-token, super-class, e2e-image, dense, random.")
    return lines + _one_class_per_super_class(moes)


def _cautions(moes: list[CellResult], by_name: dict[str, CellResult]) -> list[str]:
    """When the numbers cannot carry a conclusion either way, say so before anyone reads the rows as evidence."""
    if all(len(r.seeds) < 2 and len(by_name[r.cell.baseline].seeds) < 2 for r in moes):
        return [
            "Caution: one seed per row, so no difference here can be told from the seed-to-seed noise (a few "
            "points at this scale); run --seeds 3 or more before reading a row as for or against the paper."
        ]
    if all(_beyond_noise(r, by_name) == 0 for r in moes):
        return [
            "Caution: every difference from dense is within the seed noise (the two stds combined): these "
            "numbers neither confirm nor refute the paper's gains."
        ]
    return []


def _one_class_per_super_class(moes: list[CellResult]) -> list[str]:
    """With as many super-classes as classes, every super-class is one class: the router loss is the classification
    loss, and random super-classes are the same task as derived ones (a permutation)."""
    rows = [r.cell.row for r in moes if r.cell.super_classes and r.cell.num_experts == r.cell.config.num_classes]
    if not rows:
        return []
    where = "every MoE row" if len(rows) == len(moes) else ", ".join(rows)
    return [f"Caveat: in {where} E equals the number of classes, so each super-class is a single class "
            "(derived and random super-classes differ only by a permutation); the paper has 100 classes per "
            "super-class."]  # fmt: skip


def _beyond_noise(moe: CellResult, by_name: dict[str, CellResult]) -> int:
    """+1 (-1) when the MoE is above (below) its baseline by more than the two seed stds combined, else 0 (or with
    one seed, where there is no std to measure the noise by)."""
    spread = (moe.std("top1") or 0) + (by_name[moe.cell.baseline].std("top1") or 0)
    difference = delta(moe, by_name)
    if spread == 0 or abs(difference) <= 100 * spread:
        return 0
    return 1 if difference > 0 else -1


def markdown(fig: Figure, results: list[CellResult], setting: Setting, bench: bool) -> str:
    lines = [
        f"# {fig.name}: {fig.title}",
        "",
        f"Ours: `{setting.data}` ({setting.split} split), scale `{setting.scale}`, {setting.trained_for}, "
        f"top-1 % as mean ± std over {counted(setting.seeds, 'seed')}. Paper: ImageNet-1k val, 300 epochs. Δ: top-1 "
        "over the dense baseline (FLOPs-matched in fig3d/fig3e). `ours` names the model trained in the paper's "
        "model's place (depth x width / patch).",
        "",
        markdown_table(table_rows(fig, results, bench)),
        "",
        "## The paper's claim and ours",
        "",
        *(f"- {line}" for line in claims(fig, results)),
    ]
    lines += ["", f"![{fig.name}: {fig.title}]({fig.name}.png)"]
    if bench:
        lines += ["", "Latency: ExecuTorch bundle of each cell's seed-0 run on the native runner, 1 thread, this host; "
                  "all bundles in one bench run (DIR/bench/report.md has the spread).", "",
                  f"![{fig.name}: accuracy vs measured latency]({fig.name}-latency.png)"]  # fmt: skip
    return "\n".join(lines) + "\n"


# --- the CSV ----------------------------------------------------------------------------------------------------------

CSV_FIELDS = [
    "figure", "cell", "row", "role", "status", "model", "ours", "image_size", "routing", "num_experts", "top_k",
    "moe_layers", "super_classes", "recipe", "epochs", "seeds", "params_total", "params_active", "flops", "top1_mean",
    "top1_std", "router_accuracy_mean", "router_accuracy_std", "experts_per_image", "baseline", "delta_top1",
    "paper_top1", "paper_delta", "paper_router", "paper_mflops", "p50_ms", "peak_rss_bytes",
    "bytes_loaded_per_image",
]  # fmt: skip


def csv_rows(fig: Figure, results: list[CellResult], epochs: dict[str, int]) -> list[dict[str, Any]]:
    by_name = {r.cell.name: r for r in results}
    rows = []
    for result in results:
        cell, config = result.cell, result.cell.config
        rows.append({
            "figure": fig.name, "cell": cell.name, "row": cell.row, "role": cell.role, "status": result.status,
            "model": config.name if config else None, "ours": cell.backbone.size,
            "image_size": config.image_size if config else None, "routing": config.routing if config else None,
            "num_experts": cell.num_experts, "top_k": getattr(config, "top_k", None),
            "moe_layers": getattr(config, "moe_layers", None), "super_classes": cell.super_classes,
            "recipe": cell.recipe, "epochs": epochs.get(cell.name), "seeds": len(result.seeds), **result.costs,
            "top1_mean": pct(result.mean("top1")), "top1_std": pct(result.std("top1")),
            "router_accuracy_mean": pct(result.mean("router_accuracy")),
            "router_accuracy_std": pct(result.std("router_accuracy")),
            "experts_per_image": result.mean("experts_per_image_mean"), "baseline": cell.baseline,
            "delta_top1": delta(result, by_name), "paper_top1": cell.paper.get("top1"),
            "paper_delta": cell.paper.get("delta"), "paper_router": cell.paper.get("router"),
            "paper_mflops": cell.paper.get("mflops"), **{k: result.bench.get(k) for k in
                                                         ("p50_ms", "peak_rss_bytes", "bytes_loaded_per_image")},
        })  # fmt: skip
    return rows


def csv_text(rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: ("" if v is None else round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
                     for row in rows)  # fmt: skip
    return buffer.getvalue()


# --- the plots --------------------------------------------------------------------------------------------------------


def _measured(results: list[CellResult], role: str | None = None) -> list[CellResult]:
    return [r for r in results if r.mean("top1") is not None and (role is None or r.cell.role == role)]


def _bar_label(result: CellResult) -> str:
    row = result.cell.row
    return row if result.cell.role == "moe" or "dense" in row else f"{row} (dense)"


def _trained_on(setting: Setting) -> str:
    """A plot title's second line: what our numbers and the paper's were measured on."""
    trained = f"{setting.data} ({setting.split} split), scale {setting.scale}, {setting.trained_for}"
    return f"ours: {trained}, {counted(setting.seeds, 'seed')}; paper: ImageNet-1k val, 300 epochs"


def _spread(results: list[CellResult], key: str = "top1") -> list[float] | None:
    """Error bars of the seed std, or None with one seed (a cap on one number would claim a spread never seen)."""
    if all(len(r.seeds) < 2 for r in results):
        return None
    return [pct(r.std(key) or 0) for r in results]


def _scatter_figure(axis, results: list[CellResult]) -> None:
    """Fig. 1 / 3a: accuracy against FLOPs, dense and MoE, the paper's points beside ours (hollow)."""
    for role, label, marker in (("dense", "Dense ViT", "s"), ("moe", "Mobile V-MoE", "o")):
        points = sorted(_measured(results, role), key=lambda r: r.costs["flops"])
        axis.errorbar(
            [r.costs["flops"] / 1e6 for r in points],
            [pct(r.mean("top1")) for r in points],
            yerr=_spread(points),
            marker=marker,
            linestyle="",
            capsize=3,
            label=f"{label} (ours)",
        )
        for r in points:
            axis.annotate(
                r.cell.row,
                (r.costs["flops"] / 1e6, pct(r.mean("top1"))),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
        paper = [r for r in points if r.cell.paper.get("top1") is not None and r.cell.paper.get("mflops")]
        axis.scatter(
            [r.cell.paper["mflops"] for r in paper],
            [r.cell.paper["top1"] for r in paper],
            marker=marker,
            facecolors="none",
            edgecolors="gray",
            label=f"{label} (paper, ImageNet)",
        )
    axis.set_xscale("log")
    axis.set_xlabel("MFLOPs per image")
    axis.set_ylim(0, 100)


def _paper_marks(axis, bars: list[tuple[float, CellResult]], key: str, color: str, label: str) -> None:
    """The paper's number for each bar that has one, as a short line across the bar."""
    marks = [(x, r.cell.paper[key]) for x, r in bars if r.cell.paper.get(key) is not None]
    if marks:
        axis.scatter([x for x, _ in marks], [y for _, y in marks], marker="_", s=300, color=color, zorder=3,
                     label=label)  # fmt: skip


def _bar_figure(axis, results: list[CellResult]) -> None:
    """Fig. 3b-e: top-1 per row from zero; router accuracy beside it where the figure reports one; the paper's
    numbers as marks on the same scale."""
    measured = _measured(results)
    routers = [r for r in measured if r.mean("router_accuracy") is not None]
    width = 0.4 if routers else 0.8
    top1_at = [(i - width / 2 if routers else i, r) for i, r in enumerate(measured)]
    axis.bar([x for x, _ in top1_at], [pct(r.mean("top1")) for r in measured], width=width, capsize=3,
             color=["tab:blue" if r.cell.role == "moe" else "tab:gray" for r in measured],
             yerr=_spread(measured), label="top-1 (ours; gray: dense)")  # fmt: skip
    _paper_marks(axis, top1_at, "top1", "black", "top-1 (paper, ImageNet)")
    if routers:
        router_at = [(i + width / 2, r) for i, r in enumerate(measured) if r in routers]
        axis.bar([x for x, _ in router_at], [pct(r.mean("router_accuracy")) for r in routers], width=width,
                 color="tab:orange", yerr=_spread(routers, "router_accuracy"), capsize=3,
                 label="router accuracy (ours)")  # fmt: skip
        _paper_marks(axis, router_at, "router", "saddlebrown", "router accuracy (paper)")
    axis.set_xticks(range(len(measured)), [_bar_label(r) for r in measured], rotation=30, ha="right", fontsize=8)
    axis.set_ylim(0, 100)


def plot_figure(fig: Figure, results: list[CellResult], setting: Setting, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    (_scatter_figure if fig.name in ("fig1", "fig3a") else _bar_figure)(axis, results)
    axis.set_ylabel(f"accuracy (%, {setting.split} split)")
    axis.set_title(f"{fig.name}: {fig.title}\n{_trained_on(setting)}", fontsize=9)
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
    save_figure(figure, path)
    plt.close(figure)


def plot_latency(fig: Figure, results: list[CellResult], setting: Setting, path: Path) -> None:
    """Accuracy vs measured p50 latency: the comparison the paper does not make."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for role, label, marker in (("dense", "dense", "s"), ("moe", "MoE", "o")):
        points = [r for r in _measured(results, role) if r.bench]
        axis.errorbar([r.bench["p50_ms"] for r in points], [pct(r.mean("top1")) for r in points],
                      yerr=_spread(points), marker=marker, linestyle="", capsize=3, label=label)  # fmt: skip
        for r in points:
            axis.annotate(r.cell.row, (r.bench["p50_ms"], pct(r.mean("top1"))), fontsize=7,
                          xytext=(4, 4), textcoords="offset points")  # fmt: skip
    axis.set_xlim(left=0)  # latency from 0, accuracy zoomed to the points: the trade-off at a glance
    axis.set_xlabel("p50 latency per image (ms, native runner, 1 thread, this host)")
    axis.set_ylabel(f"top-1 (%, {setting.split} split)")
    axis.set_title(f"{fig.name}: accuracy vs measured latency\n{_trained_on(setting)}", fontsize=9)
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
    save_figure(figure, path)
    plt.close(figure)


def write_outputs(fig: Figure, results: list[CellResult], setting: Setting, epochs: dict[str, int], out: Path,
                  bench: bool) -> list[Path]:  # fmt: skip
    """The figure's table (.md), rows (.csv) and plot (.png; with bench its latency plot too), replaced as one set
    (atomic.atomic_files): an interrupted reproduce leaves the earlier set, never a new table beside an old plot."""
    names = [f"{fig.name}.md", f"{fig.name}.csv", f"{fig.name}.png"] + ([f"{fig.name}-latency.png"] if bench else [])
    paths = [out / name for name in names]
    with atomic_files(paths) as staged:  # private paths: written directly, the set renamed into place at the end
        staged[0].write_text(markdown(fig, results, setting, bench), encoding="utf-8", errors="surrogateescape")
        staged[1].write_text(csv_text(csv_rows(fig, results, epochs)), encoding="utf-8", errors="surrogateescape")
        plot_figure(fig, results, setting, staged[2])
        if bench:
            plot_latency(fig, results, setting, staged[3])
    return paths
