"""The export step of `mobile-moe demo`: bundles for trained runs, one line each, and a prediction through each.

from mobile_moe.export.demo import export_demo
rows = export_demo({"mobile-vmoe": moe_run_dir, "vit": dense_run_dir}, out_dir / "bundles")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mobile_moe.export.bundle import export_bundle
from mobile_moe.export.loaded_graphs import coreml_runs_here
from mobile_moe.export.manifest_schema import Manifest
from mobile_moe.export.runtime import load_bundle
from mobile_moe.export.source import source_from_run
from mobile_moe.utils.words import counted

FORMATS = ("executorch", "onnx", "coreml")


def _bundle_line(name: str, manifest: Manifest) -> str:
    sizes, parity = manifest.sizes, manifest.parity
    held = sizes.get("resident_plus_one_expert_bytes")
    held_text = f", router + 1 expert {held / 1e6:.2f} MB" if held else ""
    return (
        f"  {name:<28} {counted(len(manifest.graphs), 'graph'):>9}, {sizes['total_bytes'] / 1e6:6.2f} MB{held_text}; "
        f"parity max |dp| {parity['max_abs_prob_error']:.1e} ({parity['checked_on']})"
    )


def export_demo(
    runs: Mapping[str, str | Path],
    out_dir: str | Path,
    formats: Sequence[str] = FORMATS,
    monolithic: bool = True,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Export every run in every format (plus the monolithic ExecuTorch bundle of MoE runs) under `out_dir`, print a
    line per bundle and the first validation image's prediction through each bundle this machine can run.

    Returns one dict per bundle: {"name", "path", "manifest", "prediction" (predict --json record or None)}.
    """
    out_dir = Path(out_dir)
    rows = []
    log(f"\nExport: bundles under {out_dir}")
    for label, run_dir in runs.items():
        source = source_from_run(run_dir)
        jobs = [(fmt, {}) for fmt in formats]
        if monolithic and source.model.config.name != "vit" and "executorch" in formats:
            jobs.append(("executorch", {"monolithic": True}))
        for fmt, options in jobs:
            name = f"{label}-{fmt}" + ("-monolithic" if options else "")
            manifest = export_bundle(source.model, out_dir / name, fmt, **options, **source.export_kwargs())
            log(_bundle_line(name, manifest))
            rows.append({"name": name, "path": out_dir / name, "manifest": manifest, "prediction": None})
            if fmt == "coreml" and not coreml_runs_here():
                continue
            bundle = load_bundle(out_dir / name)
            prediction = bundle.predict(source.val_data[0][0])
            index = int(prediction.logits.argmax())
            rows[-1]["prediction"] = {
                "class": manifest.class_names[index],
                "label": manifest.class_names[int(source.val_data[1][0])],
                "experts": prediction.experts,
                "loaded_graphs": bundle.loaded_graphs,
            }
    first = next((row for row in rows if row["prediction"] and row["prediction"]["experts"]), None)
    if first:
        p = first["prediction"]
        log(
            f"  {first['name']}: first val image (label {p['label']}) -> {p['class']}, expert(s) {p['experts']}, "
            f"graphs loaded: {', '.join(p['loaded_graphs'])}"
        )
    return rows
