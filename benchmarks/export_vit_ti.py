"""Export the paper's ViT-Ti/32 Mobile V-MoE (12x192, patch 32, 224 px, 1000 classes, E=10, k=1, L=2), built in code
with random weights, to every backend: split, monolithic and int8; print wall time, sizes and parity.

    python benchmarks/export_vit_ti.py [--backends executorch onnx coreml] [--variants split monolithic int8]
                                       [--out bench-export] [--json results.json]

"router + one expert" is what a phone holds for one image with the split bundle; "monolithic" is the naive single
graph holding all experts; the ratio between them is what splitting buys. Wall times are one export each on a shared
machine: read them as rough. Parity runs on 8 random images (there is no data for a 1000-class random model);
int8 accuracy needs a validation split and is not measured here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from mobile_moe.export.bundle import export_bundle
from mobile_moe.models.registry import create_model

# split: router + one graph per expert path (k=1 default); per-block: shared attention in its own graphs, experts
# hold only their MLPs; monolithic: every expert in one graph; int8: the split bundle quantized.
VARIANTS = {
    "split": {},
    "per-block": {"layout": "per-block"},
    "monolithic": {"monolithic": True},
    "int8": {"quantize": "int8"},
}


def export_one(model, backend: str, variant: str, out: Path, images: torch.Tensor) -> dict:
    start = time.perf_counter()
    manifest = export_bundle(
        model,
        out,
        backend,
        sample_images=images,
        calibration_images=images,
        **VARIANTS[variant],
        log=lambda message: print("   ", message, flush=True),
    )
    seconds = time.perf_counter() - start
    graphs = {g.name: g.load_bytes for g in manifest.graphs}
    undelegated = sorted({op for g in manifest.graphs for op in g.backend_details.get("undelegated_ops", [])})
    parity = manifest.parity
    return {
        "backend": backend,
        "variant": variant,
        "precision": manifest.precision,
        "export_seconds": round(seconds, 1),
        "graph_seconds": {g.name: g.export_seconds for g in manifest.graphs},
        "graph_bytes": graphs,
        "sizes": manifest.sizes,
        "parity": {
            k: parity[k]
            for k in ("max_abs_logit_error", "max_abs_prob_error", "expert_agreement", "checked_on")
            if k in parity
        },
        "undelegated_ops": undelegated,
    }


def mb(n: int) -> str:
    return f"{n / 1e6:7.2f} MB"


def print_summary(rows: list[dict]) -> None:
    print("\nViT-Ti/32 Mobile V-MoE (E=10, k=1, L=2), random weights")
    print(
        f"{'backend':<11}{'variant':<11}{'precision':<28}{'export s':>9}{'total':>11}{'router':>11}"
        f"{'1 expert':>11}{'r + 1 exp':>11}{'max|dp|':>10}{'experts':>8}"
    )
    for row in rows:
        sizes, graphs = row["sizes"], row["graph_bytes"]
        router = graphs.get("router")
        expert = sizes.get("max_expert_bytes")
        print(
            f"{row['backend']:<11}{row['variant']:<11}{row['precision']:<28}{row['export_seconds']:>9.1f}"
            f"{mb(sizes['total_bytes']):>11}{mb(router) if router else '-':>11}{mb(expert) if expert else '-':>11}"
            f"{mb(sizes.get('resident_plus_one_expert_bytes', sizes['total_bytes'])):>11}"
            f"{row['parity']['max_abs_prob_error']:>10.1e}{row['parity'].get('expert_agreement', 1.0):>8.2f}"
        )
    for backend in sorted({row["backend"] for row in rows}):
        by_variant = {row["variant"]: row for row in rows if row["backend"] == backend}
        if "split" in by_variant and "monolithic" in by_variant:
            held = by_variant["split"]["sizes"]["resident_plus_one_expert_bytes"]
            whole = by_variant["monolithic"]["sizes"]["total_bytes"]
            print(f"{backend}: router + one expert = {held / whole:.2f} x monolithic ({mb(held)} vs {mb(whole)})")
        if "split" in by_variant and "int8" in by_variant:
            ratio = by_variant["int8"]["sizes"]["total_bytes"] / by_variant["split"]["sizes"]["total_bytes"]
            print(f"{backend}: int8 bundle = {ratio:.2f} x fp32 split bundle")
        undelegated = {v: r["undelegated_ops"] for v, r in by_variant.items() if r["undelegated_ops"]}
        if undelegated:
            print(f"{backend}: ops left outside the delegate: {undelegated}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["executorch", "onnx", "coreml"])
    parser.add_argument("--variants", nargs="+", default=["split", "monolithic", "int8"], choices=list(VARIANTS))
    parser.add_argument("--out", default="bench-export", help="scratch directory for the bundles (removed after)")
    parser.add_argument("--keep", action="store_true", help="keep the bundles")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = create_model("mobile-vmoe", "12x192").eval()  # patch 32, 224 px, 1000 classes, E=10, k=1, L=2
    images = torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    rows = []
    for backend in args.backends:
        for variant in args.variants:
            out = Path(args.out) / f"{backend}-{variant}"
            print(f"== {backend} {variant}", flush=True)
            rows.append(export_one(model, backend, variant, out, images))
            if not args.keep:
                shutil.rmtree(out)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print_summary(rows)


if __name__ == "__main__":
    main()
