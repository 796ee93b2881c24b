"""ONNX exporter: torch.onnx.export (dynamo) -> onnx.checker -> .onnx; int8 through onnxruntime.quantization.

int8 here is dynamic quantization (int8 weights, activations quantized per call from their observed range): it is
ONNX Runtime's recommended scheme for transformer MatMuls on CPU and needs no calibration set, so `calibration` is
accepted for the shared signature and unused.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from export.artifact import Artifact

SUFFIX = ".onnx"
OPSET = 18


def _export_fp32(module: nn.Module, example_inputs, out_path: Path, input_names, output_names) -> None:
    import onnx

    with torch.no_grad():
        torch.onnx.export(
            module.eval(),
            example_inputs,
            str(out_path),
            dynamo=True,
            input_names=list(input_names),
            output_names=list(output_names),
            opset_version=OPSET,
            external_data=False,  # one self-contained file per graph: the manifest hashes exactly what is loaded
            verbose=False,
        )
    onnx.checker.check_model(str(out_path), full_check=True)


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

    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory(dir=out_path.parent) as scratch:
        fp32, prepared = Path(scratch) / "fp32.onnx", Path(scratch) / "prepared.onnx"
        _export_fp32(module, example_inputs, fp32, input_names, output_names)
        quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
        quantize_dynamic(str(prepared), str(out_path), weight_type=QuantType.QInt8)
    import onnx

    onnx.checker.check_model(str(out_path))
    return Artifact(out_path, {"opset": OPSET, "precision": "int8 weights, dynamic int8 activations"})
