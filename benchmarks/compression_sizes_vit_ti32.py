"""Bytes of each compression choice on ONNX and Core ML for the paper's ViT-Ti/32 Mobile V-MoE (1000 classes, E=10,
k=1, L=2; random weights, so sizes only: Linux converts Core ML packages but cannot run them), per-block layout:

    python benchmarks/compression_sizes_vit_ti32.py [--out DIR]

For each backend and choice: bytes on disk, and bytes resident for the router + shared graphs + one expert; ratios
against the same backend's MoE in 8 bits everywhere and its dense ViT-Ti/32 in 8 bits, exported in the same run.
ExecuTorch's rows, with latency, are benchmarks/compression_vit_ti32.py's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from compression_vit_ti32 import paper_models

from mobile_moe.export.bundle import export_bundle

# backend -> [(label, export_bundle's precision options)]; the first 8-bit choice of each is its baseline
CHOICES = {
    "onnx": [("none", {}), ("int8", {"quantize": "int8"})],
    "coreml": [
        ("fp16", {}),
        ("linear8", {"quantize": "int8"}),
        ("linear4", {"quantize": "int8", "coreml_compression": "linear4"}),
        ("palette4", {"quantize": "int8", "coreml_compression": "palette4"}),
        ("experts=linear4,rest=linear8", {"quantize": "int8", "coreml_compression": "experts=linear4,rest=linear8"}),
        ("experts=palette4,rest=linear8", {"quantize": "int8", "coreml_compression": "experts=palette4,rest=linear8"}),
    ],
}
BASELINE = {"onnx": "int8", "coreml": "linear8"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="keep the bundles here (default: a temp dir)")
    args = parser.parse_args()
    moe, dense = paper_models()
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        print("| backend | choice | bundle MB | / MoE 8-bit | router + 1 expert MB | / dense 8-bit |\n"
              "|---|---|---:|---:|---:|---:|")  # fmt: skip
        for backend, choices in CHOICES.items():
            options = dict(choices)
            dense_bytes = export_bundle(dense, out / f"{backend}-dense", backend, **options[BASELINE[backend]]).sizes[
                "total_bytes"
            ]
            sizes = {label: export_bundle(moe, out / f"{backend}-{index}", backend, layout="per-block", **chosen).sizes
                     for index, (label, chosen) in enumerate(choices)}  # fmt: skip
            moe_bytes = sizes[BASELINE[backend]]["total_bytes"]
            for label, size in sizes.items():
                total, held = size["total_bytes"], size["resident_plus_one_expert_bytes"]
                print(f"| {backend} | {label} | {total / 1e6:.2f} | {total / moe_bytes:.3f} | {held / 1e6:.2f} "
                      f"| {held / dense_bytes:.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
