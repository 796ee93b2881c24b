"""--bench: what each cell costs on a device, measured. Each cell's seed-0 run is exported to ExecuTorch once
(DIR/bundles/CELL) and every bundle is benchmarked in one `bench` run (DIR/bench: results.json, report.md), so the
latencies of a figure are measured side by side on the same host, in the same minutes."""

from __future__ import annotations

from pathlib import Path

from mobile_moe.device_bench.bench import bench_bundles
from mobile_moe.evidence.results import CellResult
from mobile_moe.evidence.sweep import run_dir
from mobile_moe.export.bundle import export_bundle
from mobile_moe.export.manifest import MANIFEST
from mobile_moe.export.source import source_from_run


def export_cell(out: Path, result: CellResult, log) -> Path:
    """The cell's seed-0 run as an ExecuTorch bundle, exported again only when best.pt is newer than the bundle."""
    bundle, run = out / "bundles" / result.cell.name, run_dir(out, result.cell, 0)
    manifest = bundle / MANIFEST
    if manifest.is_file() and manifest.stat().st_mtime_ns >= (run / "best.pt").stat().st_mtime_ns:
        return bundle
    source = source_from_run(run)
    log(f"exporting {result.cell.name} -> {bundle}")
    export_bundle(source.model, bundle, "executorch", **source.export_kwargs())
    return bundle


def bench_cells(out: Path, results: list[CellResult], data: str, iterations: int, log) -> None:
    """Fill each measured cell's `bench` with p50 latency, peak memory and graph bytes loaded per image (native runner,
    one thread, images from the data's test split)."""
    measured = [r for r in results if any(s["seed"] == 0 for s in r.seeds)]
    bundles = {str(export_cell(out, result, log)): result for result in measured}
    if not bundles:
        return
    report = bench_bundles(list(bundles), out / "bench", runtime="native", iterations=iterations, data=data, log=log)
    for run in report["runs"]:
        bundles[run["bundle"]].bench = {
            "p50_ms": run["latency_ms"]["p50"],
            "peak_rss_bytes": run["peak_rss_bytes"],
            "bytes_loaded_per_image": run["bytes_loaded_per_image"],
        }
