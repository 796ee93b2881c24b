"""report.md and plots from results.json: a table per run, side-by-side comparisons, latency/memory bars, and
accuracy vs FLOPs (the paper's Fig. 1) when the bundles carry accuracies."""

from __future__ import annotations

from pathlib import Path

from mobile_moe.utils.atomic import write_text_atomic
from mobile_moe.utils.plot_files import save_figure


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _millions(value) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


def _rate(value) -> str:
    return "-" if value is None else f"{value:.2f}"


WIDE_ADVICE = (
    "Runs marked WIDE disagree across rounds by more than 10% (p50): treat them as noisy. To narrow them, run on a "
    "quiet machine (nothing else running: the spread is mostly other work taking the cores), give more --iterations "
    "(each round's p50 over more runs) and more --rounds (the median over more processes), and compare only runs of "
    "one bench, whose rounds interleave the bundles."
)


def _workloads(runs: list[dict]) -> str:
    """The distinct workloads of the runs, for the report's header."""
    return "; ".join(dict.fromkeys(run.get("workload", "?") for run in runs))


def _configurations(runs: list[dict]) -> str:
    """Which configuration of libmobile_moe's options the runs ran (what an app's defaults give, unless said), with
    the experts each run kept loaded."""
    kept = "; ".join(f"{run['bundle_name']} kept {run['cache_experts']} expert graph(s) loaded"
                     for run in runs if run.get("cache_experts"))  # fmt: skip
    options = "; ".join(dict.fromkeys(run.get("options", "?") for run in runs))
    return options + (f" ({kept})" if kept else "")


def _label(run: dict) -> str:
    return f"{run['bundle_name']} ({run['runtime']}, {run['device']})"


def _named(kind: str, run: dict) -> str:
    """'dense dn' for a bundle named dn; a bundle whose name says its kind already ('dense') is not named twice."""
    name = run["bundle_name"]
    return name if kind in name.lower() else f"{kind} {name}"


def _same_place(a: dict, b: dict) -> bool:
    return (a["runtime"], a["device"]) == (b["runtime"], b["device"])


def _runtime_label(run: dict) -> str:
    return f"{run['runtime']}, EMULATED" if run.get("emulated") else run["runtime"]


def _split_vs_whole(split: dict, whole: dict) -> str:
    """A split per-image MoE loads its router and the experts an image picks; a whole per-token MoE loads every expert
    for every image, whatever its tokens used. Bytes and parameters loaded per image, beside what each computes with."""
    params = (_millions(run.get("params_loaded_per_image")) for run in (split, whole))
    return (
        f"- split {split['bundle_name']} vs whole {whole['bundle_name']} ({_runtime_label(split)}): graph bytes per "
        f"image {_mib(split['bytes_loaded_per_image'])} vs {_mib(whole['bytes_loaded_per_image'])} MiB (router + "
        f"chosen experts vs every expert), parameters loaded per image {' vs '.join(params)} M (active at most "
        f"{_millions(split['params_active'])} vs {_millions(whole['params_active'])} M), peak RSS "
        f"{_mib(split['peak_rss_bytes'])} vs {_mib(whole['peak_rss_bytes'])} MiB, p50 "
        f"{_ms(split['latency_ms']['p50'])} vs {_ms(whole['latency_ms']['p50'])} ms"
    )


def _memory_ratio(moe: dict, dense: dict) -> str:
    """Peak RSS of two runs, and of the model's own share (over the process before it loaded anything)."""
    text = f"peak RSS {_mib(moe['peak_rss_bytes'])} vs {_mib(dense['peak_rss_bytes'])} MiB"
    if moe["peak_rss_bytes"] and dense["peak_rss_bytes"]:
        text += f" ({moe['peak_rss_bytes'] / dense['peak_rss_bytes']:.3f}x)"
    if moe.get("model_peak_bytes") and dense.get("model_peak_bytes"):
        text += (f", the model's share {_mib(moe['model_peak_bytes'])} vs {_mib(dense['model_peak_bytes'])} MiB "
                 f"({moe['model_peak_bytes'] / dense['model_peak_bytes']:.3f}x)")  # fmt: skip
    return text


def cache_lines(runs: list[dict]) -> list[str]:
    """Which native runs kept XNNPACK's packed weights on disk, and what the one cache folder held: said once, since
    every bundle's runs share the folder (a figure per bundle read as each bundle's own)."""
    native = [run for run in runs if run.get("weight_cache") is not None]
    cached = [run for run in native if run["weight_cache"]]
    lines = [f"- {_label(run)}: packed-weight cache off" for run in native if not run["weight_cache"]]
    if cached:
        held = max(run["weight_cache_bytes"] or 0 for run in cached)  # the folder after the last round
        lines.insert(0, f"- packed-weight cache on for {', '.join(_label(run) for run in cached)}; the cache folder "
                        f"held {_mib(held)} MiB after the last round (every bundle's packed weights, earlier runs' "
                        "too)")  # fmt: skip
    return lines


def stream_lines(runs: list[dict]) -> list[str]:
    """What the p50 hides: how often the run's stream changed expert, and what each change cost over a hit."""
    lines = []
    for run in runs:
        rate, switch = run.get("expert_change_rate"), run.get("switch") or {}
        if rate is None or switch.get("added_ms") is None:
            continue
        added, p50 = switch["added_ms"], run["latency_ms"]["p50"]
        ratio = f"{added / p50:.2g}" if added < 10 * p50 else f"{added / p50:.0f}"  # 0.0013x, 0.3x, 150x
        cost = f"{_ms(added)} ms over a hit ({ratio}x the warm p50 of {_ms(p50)} ms)"
        why = (
            "; the stream is the split's first images, in class order: --order stratified draws across classes"
            if "(val, first" in run.get("workload", "")
            else ""
        )
        lines.append(
            f"- {_label(run)}: the expert never changed between consecutive images of {run.get('workload', '?')}"
            f"{why}; a change (measured apart) adds {cost}" if rate == 0 else
            f"- {_label(run)}: the expert changed on {rate:.0%} of consecutive images; each change added {cost}, "
            f"about {_ms(rate * added)} ms per image on average"
        )  # fmt: skip
    return lines


def comparisons(runs: list[dict]) -> list[str]:
    """Sentences for the pairs the issue asks to see side by side: dense vs MoE, split vs monolithic, split (a
    per-image MoE) vs whole (a per-token MoE)."""
    lines = []
    by_kind: dict[str, list[dict]] = {}
    for run in runs:
        by_kind.setdefault(run["kind"], []).append(run)
    for moe in by_kind.get("split", []) + by_kind.get("whole", []):
        for dense in by_kind.get("dense", []):
            if _same_place(moe, dense):
                ratio = moe["latency_ms"]["p50"] / dense["latency_ms"]["p50"]
                lines.append(
                    f"- {moe['bundle_name']} vs {_named('dense', dense)} ({_runtime_label(moe)}): end-to-end p50 "
                    f"{_ms(moe['latency_ms']['p50'])} ms vs {_ms(dense['latency_ms']['p50'])} ms, ratio {ratio:.3f}; "
                    f"{_memory_ratio(moe, dense)}"
                )
    for moe in by_kind.get("split", []):
        for whole in by_kind.get("whole", []):
            if _same_place(moe, whole):
                lines.append(_split_vs_whole(moe, whole))
        for mono in by_kind.get("monolithic", []):
            if _same_place(moe, mono):
                lines.append(
                    f"- {_named('split', moe)} vs {_named('monolithic', mono)} ({_runtime_label(moe)}): "
                    f"peak RSS {_mib(moe['peak_rss_bytes'])} vs {_mib(mono['peak_rss_bytes'])} MiB, graph bytes per "
                    f"image {_mib(moe['bytes_loaded_per_image'])} vs {_mib(mono['bytes_loaded_per_image'])} MiB, p50 "
                    f"{_ms(moe['latency_ms']['p50'])} vs {_ms(mono['latency_ms']['p50'])} ms: {MONOLITHIC_WHY}"
                )
    return lines


def _top1(run: dict) -> str:
    """'80.3% (test)': the accuracy a report compares bundles with, named by its split, and for a quantized bundle
    said to be its fp32 checkpoint's ('80.3% (test, fp32)'); '-' when unknown."""
    if run.get("accuracy") is None:
        return "-"
    named = [run["accuracy_split"]] if run.get("accuracy_split") else []
    named += ["fp32"] if "quantized_validation" in run else []
    return f"{run['accuracy']:.1%}" + (f" ({', '.join(named)})" if named else "")


def quantized_lines(runs: list[dict]) -> list[str]:
    """What export measured of each quantized bundle itself (its top-1 column is the fp32 checkpoint's)."""
    quantized = [run for run in runs if "quantized_validation" in run]
    if not quantized:
        return []
    lines = ["", "A quantized bundle's top-1 above is its fp32 checkpoint's; export measured the bundle itself:"]
    for run in quantized:
        measured = run["quantized_validation"]
        reason = f": {measured['reason']}" if measured and measured.get("reason") else ""
        lines.append(
            f"- {run['bundle_name']}: not measured at export{reason}" if not (measured or {}).get("measured") else
            f"- {run['bundle_name']}: {measured['quantized_top1']:.1%} on {measured['images']} validation images, "
            f"against {measured['fp32_top1']:.1%} in fp32 ({100 * measured['top1_change']:+.1f} points)"
        )  # fmt: skip
    return lines


def accuracy_splits(runs: list[dict]) -> str:
    """'the test split', 'the validation split' or 'the test or validation split' (bundles of data with and without
    a test split mixed)."""
    splits = sorted({run.get("accuracy_split") or "validation" for run in runs if run.get("accuracy") is not None})
    return f"the {' or '.join(splits)} split"


def markdown(results: dict, plot_files: list[str] = ()) -> str:
    runs = results["runs"]
    lines = [
        "# Benchmark report",
        "",
        f"Host: {results.get('host', '?')}. Rounds per run: {results.get('rounds', '?')} (median shown). "
        "Latency is warm end-to-end per image; load is cold; switch = load + first run of an expert not loaded. "
        "Images are fed one at a time, as an app gets them: peak RSS is the runner's with one image in memory, and "
        "the model's share is that peak less what the process held before it loaded a graph.",
        "",
        f"Images: {_workloads(runs)}.",
        "",
        f"libmobile_moe's options: {_configurations(runs)}.",
        "",
        "| bundle | runtime | device | threads | p50 ms | p90 ms | p99 ms | mean ms | router load ms | expert load ms "
        "| switch ms | peak RSS MiB | model MiB | PSS MiB | graph MiB/image | params M loaded/image | params M active "
        "| expert change rate | top-1 | spread |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        latency, load = run["latency_ms"], run["load_ms"]
        spread = f"{run['spread']['relative']:.0%}" + (" WIDE" if run["spread"]["wide"] else "")
        lines.append(
            f"| {run['bundle_name']} | {run['runtime']} | {run['device']} | {run['threads']} | {_ms(latency['p50'])}"
            f"{' EMULATED' if run.get('emulated') else ''} "
            f"| {_ms(latency['p90'])} | {_ms(latency['p99'])} | {_ms(latency['mean'])} | {_ms(load['router'])} "
            f"| {_ms(load['expert'])} | {_ms(run['switch_ms'])} | {_mib(run['peak_rss_bytes'])} "
            f"| {_mib(run.get('model_peak_bytes'))} | {_mib(run['pss_bytes'])} | {_mib(run['bytes_loaded_per_image'])} "
            f"| {_millions(run.get('params_loaded_per_image'))} | {_millions(run['params_active'])} "
            f"| {_rate(run['expert_change_rate'])} | {_top1(run)} | {spread} |"
        )
    if any(run.get("accuracy") is not None for run in runs):
        lines += ["", f"top-1: on {accuracy_splits(runs)} of each bundle's run (export measured it; docs/formats.md)."]
    lines += quantized_lines(runs)
    caches = cache_lines(runs)
    if caches:
        lines += ["", "## Packed weights on disk (native runner)", "", *caches]
    stream = stream_lines(runs)
    if stream:
        lines += ["", "## The stream each split run served", "", *stream]
    pairs = comparisons(runs)
    if pairs:
        lines += ["", "## Side by side", "", *pairs]
    cache_rows = [run for run in runs if run["cache_hit_rate"]]
    if cache_rows:
        sizes = sorted({int(size) for run in cache_rows for size in run["cache_hit_rate"]})
        lines += ["", "## Expert cache hit rate by cache size (LRU, from the real routing sequence)", ""]
        lines += ["| bundle | " + " | ".join(str(size) for size in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for run in cache_rows:
            rates = [_rate(run["cache_hit_rate"].get(str(size))) for size in sizes]
            lines.append(f"| {_label(run)} | " + " | ".join(rates) + " |")
    if any(run.get("emulated") for run in runs):
        lines += [
            "",
            "Runs on arm64-emulated ran the runner built for ARM64 under qemu-user: their routing, files opened and "
            "bytes loaded are that runner's own, and so are their answers (against this host's below); their latency, "
            "load and switch times and memory (marked EMULATED) are the emulator's, not comparable to a phone's or to "
            "the host's.",
        ]
    if any(run["spread"]["wide"] for run in runs):
        lines += ["", WIDE_ADVICE]
    lines += ["", "Phone numbers need a real phone (`--device android`); host numbers depend on what else runs."]
    lines += parity_lines(runs)
    if plot_files:
        lines += ["", "## Plots", "", *(f"![{PLOTS[name]}]({name})" for name in plot_files)]
    return "\n".join(lines) + "\n"


def parity_lines(runs: list[dict]) -> list[str]:
    """The emulated runs' answers against this host's on the same images (results.json's host_parity)."""
    checked = [run for run in runs if run.get("host_parity")]
    if not checked:
        return []
    lines = ["", "## ARM64 (emulated) against this host, same images", ""]
    lines += ["| bundle | host runtime | max abs logit diff | same class | same experts |", "|---|---|---:|---:|---:|"]
    for run in checked:
        parity = run["host_parity"]
        lines.append(
            f"| {run['bundle_name']} | {parity['reference']} | {parity['max_abs_logit_diff']:.1e} "
            f"| {parity['same_class']}/{parity['images']} | {parity['same_experts']}/{parity['images']} |"
        )
    return lines


REPORT = "report.md"
PLOTS = {  # file -> what it shows (report.md's caption)
    "latency.png": "warm latency per image",
    "memory.png": "peak memory and graph bytes loaded per image",
    "accuracy_vs_flops.png": "accuracy against FLOPs per image",
}


def _where(results: dict) -> str:
    """A plot title's second line: where the bundles ran and on which images."""
    settings = results.get("settings") or {}
    threads = {run["threads"] for run in results["runs"]}
    thread_text = f"{'/'.join(map(str, sorted(threads)))} thread{'s' if threads != {1} else ''}"
    return f"{results.get('host', 'host ?')}; {thread_text}; images: {settings.get('data', '?')}"


def _bars(plt, results: dict, title: str):
    figure, axis = plt.subplots(figsize=(max(6, 1.6 * len(results["runs"])), 4))
    axis.set_title(f"{title}\n{_where(results)}", fontsize=9)
    return figure, axis


MONOLITHIC_WHY = (
    "a monolithic bundle computes every expert for every image (the dense mixture, one graph that "
    "never branches on data), so it runs E expert MLPs where a split bundle runs k"
)


def _latency_bars(axis, runs: list[dict]) -> None:
    """p50 bars with a whisker to p90; the report's WIDE flag hatched on the bar it concerns."""
    p50 = [run["latency_ms"]["p50"] for run in runs]
    p90 = [run["latency_ms"]["p90"] - run["latency_ms"]["p50"] for run in runs]
    bars = axis.bar(range(len(runs)), p50, yerr=[[0] * len(runs), p90], capsize=4, color="tab:blue")
    for bar, run in zip(bars, runs, strict=True):
        if run["spread"]["wide"]:
            bar.set_hatch("//")
            bar.set_facecolor("tab:orange")
            top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
            axis.annotate(f"WIDE {run['spread']['relative']:.0%}", top, xytext=(0, 2), textcoords="offset points",
                          ha="center", va="bottom", fontsize=7)  # fmt: skip
    axis.set_xticks(range(len(runs)), [_label(run) for run in runs], rotation=30, ha="right", fontsize=7)
    axis.set_ylabel("ms")
    axis.set_ylim(bottom=0)


def _slowest(runs: list[dict]) -> float:
    return max(run["latency_ms"]["p50"] for run in runs)


OWN_PANEL = 4.0  # a monolithic bundle this many times the slowest other bundle's p50 is drawn on an axis of its own


def _latency_plot(plt, results: dict):
    """One panel; monolithic bundles many times slower (OWN_PANEL) on a panel and axis of their own beside it, so
    the bundles a phone would ship are not slivers next to them."""
    runs = results["runs"]
    title = "Warm latency per image: p50, whisker to p90"
    if any(run["spread"]["wide"] for run in runs):
        title += "\nhatched: rounds disagree by more than 10% (WIDE): noisy"
    monolithic = [run for run in runs if run.get("kind") == "monolithic"]
    others = [run for run in runs if run.get("kind") != "monolithic"]
    if not monolithic or not others or _slowest(monolithic) < OWN_PANEL * _slowest(others):
        figure, axis = _bars(plt, results, title)
        _latency_bars(axis, runs)
        return figure
    figure, (left, right) = plt.subplots(1, 2, figsize=(max(7, 1.6 * len(runs) + 1), 4),
                                         gridspec_kw={"width_ratios": [len(others), len(monolithic)]})  # fmt: skip
    figure.suptitle(f"{title}\n{_where(results)}", fontsize=9)
    figure.subplots_adjust(top=0.78)  # the panels' own titles below the figure's
    _latency_bars(left, others)
    _latency_bars(right, monolithic)
    right.set_title("monolithic: every expert\nfor every image", fontsize=8)
    return figure


def _memory_plot(plt, results: dict):
    runs = results["runs"]
    figure, axis = _bars(plt, results, "Memory: peak RSS of the runner, the model's share of it, and graph bytes "
                         "loaded per image")  # fmt: skip
    positions = range(len(runs))
    bars = {
        "peak RSS (one image at a time)": [run["peak_rss_bytes"] for run in runs],
        "the model's share (peak less the process before loading)": [run.get("model_peak_bytes") for run in runs],
        "graph bytes loaded per image": [run["bytes_loaded_per_image"] for run in runs],
    }
    for offset, (label, values) in zip((-0.27, 0, 0.27), bars.items(), strict=True):
        axis.bar([p + offset for p in positions], [(v or 0) / 2**20 for v in values], width=0.27, label=label)
    axis.set_xticks(list(positions), [_label(run) for run in runs], rotation=30, ha="right", fontsize=7)
    axis.set_ylabel("MiB")
    axis.set_ylim(bottom=0)
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)  # beside the bars, never on one
    return figure


def _padded(values: list[float], share: float, low: float = float("-inf"), high: float = float("inf")):
    """Axis limits around `values`, padded by `share` of their range (of their size where they are all one value)."""
    least, most = min(values), max(values)
    pad = share * ((most - least) or abs(most) or 1.0)
    return max(low, least - pad), min(high, most + pad)


def _accuracy_plot(plt, results: dict, scored: list[dict]):
    """FLOPs from zero, accuracy zoomed to the points: a dense model and its Mobile V-MoE differ in FLOPs by the
    router alone, which a zoomed FLOPs axis would blow up into a gap, and in accuracy by a point or two, which an
    axis from zero would squash into one dot. Each point is numbered on the plot and named in the legend with its
    values; bundles at the same point (a split and a monolithic export) share one."""
    from matplotlib.ticker import PercentFormatter

    figure, axis = plt.subplots(figsize=(7, 4))
    axis.set_title(f"Accuracy against inference FLOPs\n{_where(results)}", fontsize=9)
    points: dict[tuple[float, float], list[dict]] = {}
    for run in scored:
        points.setdefault((run["flops"] / 1e6, run["accuracy"]), []).append(run)
    for number, ((mflops, accuracy), runs) in enumerate(points.items(), start=1):
        dense = all(run["kind"] == "dense" for run in runs)
        names = ", ".join(run["bundle_name"] for run in runs)
        axis.scatter(mflops, accuracy, marker="o" if dense else "s", label=f"{number}. {names}: {mflops:.4g} MFLOPs, "
                     f"{accuracy:.1%}")  # fmt: skip
        axis.annotate(str(number), (mflops, accuracy), textcoords="offset points", xytext=(5, 5), fontsize=8)
    axis.set_xlim(0, 1.1 * max(mflops for mflops, _ in points))
    axis.set_ylim(*_padded([accuracy for _, accuracy in points], 0.5, low=0, high=1))
    axis.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=1))
    axis.set_xlabel("MFLOPs per image")
    axis.set_ylabel(f"top-1 on {accuracy_splits(scored)}")
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
    return figure


def plots(results: dict, out_dir: Path) -> list[Path]:
    """latency.png, memory.png and (with accuracies) accuracy_vs_flops.png, each titled with what it shows and where
    it was measured; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {"latency.png": _latency_plot(plt, results), "memory.png": _memory_plot(plt, results)}
    scored = [run for run in results["runs"] if run.get("accuracy") is not None and run.get("flops")]
    if scored:
        figures["accuracy_vs_flops.png"] = _accuracy_plot(plt, results, scored)
    written = []
    for name, figure in figures.items():
        save_figure(figure, out_dir / name)
        plt.close(figure)
        written.append(out_dir / name)
    return written


def write_report(results: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = plots(results, out_dir)
    write_text_atomic(out_dir / REPORT, markdown(results, [path.name for path in drawn]))
    return [out_dir / REPORT, *drawn]
