"""`mobile-moe export RUN_DIR --format executorch|onnx|coreml --out BUNDLE_DIR [--quantize SCHEME] [--monolithic]`"""

from __future__ import annotations

import argparse

from mobile_moe.export.manifest_schema import BACKENDS, SPLIT_LAYOUTS
from mobile_moe.export.quantization import COREML_COMPRESSIONS, DEFAULT_COMPRESSION
from mobile_moe.utils import jsonio
from mobile_moe.utils.words import counted


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (mobile-moe train --out)")
    parser.add_argument("--format", required=True, choices=BACKENDS, help="backend of the graphs")
    parser.add_argument("--out", required=True, metavar="BUNDLE_DIR", help="bundle directory to write")
    parser.add_argument(
        "--quantize",
        default="none",
        metavar="SCHEME",
        help="none (default), int8, 8da4w (4-bit grouped weights, int8 dynamic activations: ExecuTorch), or "
        "experts=SCHEME,rest=SCHEME for the expert graphs and the others (mobile_moe/export/quantization.py)",
    )
    parser.add_argument(
        "--monolithic",
        action="store_true",
        help="a per-image MoE as one graph with every expert (the naive export); per-token MoEs always export whole",
    )
    parser.add_argument(
        "--layout",
        choices=SPLIT_LAYOUTS,
        help="per-image MoEs: expert-paths (k=1 default: one graph per expert path) or per-block (k>1 default, "
        "Mobile V-MoE: shared attention in its own graph, one graph per expert MLP per block)",
    )
    parser.add_argument("--fp32", action="store_true", help="Core ML: fp32 compute instead of fp16")
    parser.add_argument(
        "--coreml-compression",
        default=DEFAULT_COMPRESSION,
        metavar="METHOD",
        help=f"Core ML: how --quantize int8 compresses the weights: {', '.join(COREML_COMPRESSIONS)} (linear8, the "
        "default, is 8-bit per channel; linear4 is 4-bit in blocks of 32 inputs, iOS 18; paletteN an N-bit look-up "
        "table), or experts=METHOD,rest=METHOD, e.g. experts=linear4,rest=linear8 (mobile_moe/export/quantization.py)",
    )
    parser.add_argument(
        "--data",
        metavar="SPEC",
        help="images for the parity check and int8 calibration (default: the run's own data; an imported run has none)",
    )
    parser.add_argument("--checkpoint", default="best", choices=["best", "last"], help="which checkpoint to export")
    parser.add_argument("--json", action="store_true", help="print the manifest as one JSON object")


def run(args: argparse.Namespace) -> int:
    # Imported here, not above: they load torch and the backends, and `mobile-moe export --help` needs neither.
    import sys
    from pathlib import Path

    from mobile_moe.export.bundle import Lowering, check_target, export_bundle
    from mobile_moe.export.parity import parity_summary
    from mobile_moe.export.source import source_from_run

    # Before loading the run: a bad --out or precision flag fails in a second, not after the run and its images load
    check_target(Path(args.out))
    lowering = Lowering(backend=args.format, quantize=args.quantize, fp32=args.fp32,
                        coreml_compression=args.coreml_compression)  # fmt: skip
    log = (lambda message: print(message, file=sys.stderr)) if args.json else print
    calibration = 64 if "int8" in lowering.schemes.used else 0
    source = source_from_run(args.run_dir, args.checkpoint, calibration=calibration, data_spec=args.data)
    log(f"exporting {args.run_dir} ({source.model.config.name}) as {args.format} -> {args.out}")
    manifest = export_bundle(
        source.model,
        args.out,
        args.format,
        quantize=args.quantize,
        monolithic=args.monolithic,
        layout=args.layout,
        fp32=args.fp32,
        coreml_compression=args.coreml_compression,
        log=log,
        **source.export_kwargs(),
    )
    if args.json:
        print(jsonio.dumps(manifest.to_json()))
        return 0
    sizes = manifest.sizes
    print(f"wrote {args.out}: {counted(len(manifest.graphs), 'graph')}, {sizes['total_bytes'] / 1e6:.2f} MB in all")
    if "resident_plus_one_expert_bytes" in sizes:
        print(f"  router (+ shared) + one expert: {sizes['resident_plus_one_expert_bytes'] / 1e6:.2f} MB")
    parity = manifest.parity
    print(f"  parity ({parity['checked_on']}, {parity['images']} images): {parity_summary(parity)}")
    validation = manifest.quantization and manifest.quantization.validation
    if validation and validation.measured:
        print(
            f"  --quantize {args.quantize} on {validation.images} val images: top-1 {validation.quantized_top1:.3f} "
            f"vs fp32 {validation.fp32_top1:.3f} (change {validation.top1_change:+.3f})"
        )
    return 0
