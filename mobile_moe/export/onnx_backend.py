"""ONNX exporter: torch.export + the sort rewrite -> torch.onnx.export (dynamo) -> onnx.checker -> .onnx; int8
through onnxruntime.quantization.

The exporter is handed an ExportedProgram whose aten.sort ops are already rewritten
(mobile_moe/export/decompositions.py: it has no translation for the stable sort of the toolkit's top-k rule). A graph
without a sort exports to the same bytes as handing it the module itself.

int8 here is dynamic quantization (int8 weights, activations quantized per call from their observed range): it is
ONNX Runtime's recommended scheme for transformer MatMuls on CPU and needs no calibration set, so `calibration` is
accepted for the shared signature and unused.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from mobile_moe.export.artifact import Artifact
from mobile_moe.export.decompositions import sort_decompositions

SUFFIX = ".onnx"
OPSET = 18


@functools.cache
def _torchlib_registry():
    """The table of ATen -> ONNX translations. `torch.onnx.export` builds it anew on every call
    (torch/onnx/_internal/exporter/_compat.py:149, `ONNXRegistry.from_torchlib`): about 0.4 s, a quarter of a small
    graph's export, paid once per graph of a bundle. Built once per process here and handed to the exporter's core,
    which only reads it (the one writer, `register_op`, serves `custom_translation_table`, which we do not pass)."""
    from torch.onnx._internal.exporter import _registration

    return _registration.ONNXRegistry.from_torchlib(opset_version=OPSET)


def _export_fp32(module: nn.Module, example_inputs, out_path: Path, input_names, output_names) -> None:
    """What `torch.onnx.export(program, dynamo=True, opset_version=OPSET, external_data=False)` does for an
    ExportedProgram without dynamic shapes (torch/onnx/_internal/exporter/_compat.py:export_compat), with the
    registry built once: tests/export/test_export_bundles.py checks the bytes are the same."""
    import onnx
    from torch.onnx._internal.exporter import _core

    with torch.no_grad():
        program = torch.export.export(module.eval(), example_inputs).run_decompositions(sort_decompositions())
        onnx_program = _core.export(
            program,
            example_inputs,
            registry=_torchlib_registry(),
            input_names=list(input_names),
            output_names=list(output_names),
            verbose=False,
            opset_version=OPSET,
        )
        # one self-contained file per graph: the manifest hashes exactly what is loaded
        onnx_program.save(str(out_path), external_data=False)
    # The proto, not the path: onnx's checker binds a path as UTF-8 and refuses a folder name in other bytes.
    onnx.checker.check_model(onnx.load(out_path), full_check=True)


def export_onnx(
    module: nn.Module,
    example_inputs: tuple[Tensor, ...],
    out_path: str | Path,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    quantize: str = "none",
    calibration: Sequence[tuple[Tensor, ...]] = (),
    **_: object,
) -> Artifact:
    out_path = Path(out_path)
    if quantize != "int8":
        _export_fp32(module, example_inputs, out_path, input_names, output_names)
        return Artifact(out_path, {"opset": OPSET, "precision": "fp32"})

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(dir=out_path.parent) as scratch:
        fp32 = Path(scratch) / "fp32.onnx"
        _export_fp32(module, example_inputs, fp32, input_names, output_names)
        # The dynamo exporter's intermediate value_info can disagree with ONNX shape inference (seen on Linear
        # weights), which the quantizer re-runs; the shapes are re-inferred from the graph without it.
        proto = onnx.load(str(fp32))
        proto.graph.ClearField("value_info")
        onnx.save(proto, str(fp32))
        # Its advice to run onnxruntime's pre-processing goes to the root logger; that step is the one that breaks on
        # these graphs (the value_info clash above), so the advice is silenced rather than followed.
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)
        try:
            quantize_dynamic(str(fp32), str(out_path), weight_type=QuantType.QInt8)
        finally:
            root.setLevel(level)
    onnx.checker.check_model(str(out_path))
    return Artifact(out_path, {"opset": OPSET, "precision": "int8 weights, dynamic int8 activations"})
