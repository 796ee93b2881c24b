"""Core ML exporter: torch.export + a few rewrites -> coremltools 9 -> .mlpackage (ML program, iOS 17; iOS 18 for
4-bit blockwise weights).

The TorchScript trace path fails on this torch version for ViT attention, hence the ExportedProgram route.
Only aten.sort (Core ML's argsort promises no order among ties, the top-k rule does) and clamp_min/clamp_max (which
coremltools converts only for a bound of the input's dtype) are rewritten (mobile_moe/export/decompositions.py);
everything else reaches coremltools as torch.export leaves it, as with run_decompositions({}).
fp16 compute by default (what the Neural Engine runs), fp32 as an option. Compression works on the converted model:
linear 8-bit weights, linear 4-bit weights in blocks of 32 inputs, or k-means palettisation with 2**nbits entries.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from mobile_moe.export.artifact import Artifact
from mobile_moe.export.decompositions import coreml_decompositions
from mobile_moe.export.quantization import DEFAULT_COMPRESSION, GROUP, IOS18_COMPRESSIONS

SUFFIX = ".mlpackage"
TQDM_LINE = re.compile(r"\[\d+:\d+.*/s\]|%\|")  # "... [00:00, 330.04 passes/s]" or "98%|█████"


@contextlib.contextmanager
def without_progress_bars() -> Iterator[None]:
    """coremltools draws a tqdm bar per conversion pass on stderr; keep everything else it writes there."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        for line in captured.getvalue().replace("\r", "\n").splitlines():
            if line.strip() and not TQDM_LINE.search(line):
                print(line, file=sys.stderr)


def compress(mlmodel, compression: str):
    """Weight compression with coremltools.optimize.coreml (mobile_moe/export/quantization.py names the methods):
    "linear8" (int8 symmetric, per output channel), "linear4" (int4 symmetric, a scale per block of 32 inputs: the
    iOS 18 opset's blockwise dequantize) or "paletteN" (an N-bit look-up table per weight tensor)."""
    import coremltools.optimize.coreml as cto

    if compression.startswith("palette"):
        op_config = cto.OpPalettizerConfig(mode="kmeans", nbits=int(compression.removeprefix("palette")))
        return cto.palettize_weights(mlmodel, cto.OptimizationConfig(global_config=op_config))
    per_channel = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8")
    if compression == "linear8":
        return cto.linear_quantize_weights(mlmodel, cto.OptimizationConfig(global_config=per_channel))
    return cto.linear_quantize_weights(mlmodel, _in_blocks(cto, mlmodel, elsewhere=per_channel))


def _in_blocks(cto, mlmodel, *, elsewhere):
    """linear4's config: int4 in blocks of GROUP inputs; any other weight (one a linear or conv does not read, whose
    input axis coremltools picks otherwise, or whose inputs are no whole number of blocks: the patch embedding's 3
    colour channels, the position embedding's tokens) as `elsewhere` says. coremltools would leave such a weight in
    fp16 with a warning (coremltools/optimize/_utils.py:270, "Invalid block_sizes ... Unable to perform structured
    quantization")."""
    blocked = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", granularity="per_block",
                                          block_size=GROUP)  # fmt: skip
    unblockable = {
        name: elsewhere
        for name, weight in cto.get_weights_metadata(mlmodel).items()
        if not _blocks_on_input_axis(weight)
    }
    return cto.OptimizationConfig(global_config=blocked, op_name_configs=unblockable)


def _blocks_on_input_axis(weight) -> bool:
    """A linear's or conv's weight, (out, in, ...), whose `in` is whole blocks of GROUP: axis 1 is the one coremltools
    blocks for those ops (a block of [1, block_size, ...], OpLinearQuantizerConfig's doc)."""
    readers = {child.op_type for child in weight.child_ops}
    return readers <= {"linear", "conv"} and weight.val.ndim >= 2 and weight.val.shape[1] % GROUP == 0


def export_coreml(
    module: nn.Module,
    example_inputs: tuple[Tensor, ...],
    out_path: str | Path,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    quantize: str = "none",
    fp32: bool = False,
    coreml_compression: str = DEFAULT_COMPRESSION,
    descriptions: Mapping[str, str] | None = None,
    summary: str = "",
    **_: object,
) -> Artifact:
    import coremltools as ct

    with torch.no_grad():
        program = torch.export.export(module.eval(), example_inputs).run_decompositions(coreml_decompositions())
    compression = coreml_compression if quantize == "int8" else None
    target = "iOS18" if compression in IOS18_COMPRESSIONS else "iOS17"
    with without_progress_bars():
        mlmodel = _convert(ct, program, example_inputs, input_names, output_names, fp32, target)
        if compression is not None:
            mlmodel = compress(mlmodel, compression)
    _describe(mlmodel, input_names, output_names, descriptions or {}, summary)
    mlmodel.save(str(out_path))
    precision = "fp32" if fp32 else "fp16"
    details = {"compute_precision": precision, "weights": compression or precision, "target": target}
    return Artifact(Path(out_path), details)


def _convert(ct, program, example_inputs, input_names, output_names, fp32: bool, target: str):
    return ct.convert(
        program,
        inputs=[
            ct.TensorType(name=name, shape=tuple(x.shape), dtype=np.float32)
            for name, x in zip(input_names, example_inputs, strict=True)
        ],
        outputs=[ct.TensorType(name=name, dtype=np.float32) for name in output_names],
        convert_to="mlprogram",
        minimum_deployment_target=getattr(ct.target, target),
        compute_precision=ct.precision.FLOAT32 if fp32 else ct.precision.FLOAT16,
        skip_model_load=True,  # loading compiles the model, which only macOS can do
    )


def _describe(mlmodel, input_names, output_names, descriptions: Mapping[str, str], summary: str) -> None:
    for name in input_names:
        if descriptions.get(name):
            mlmodel.input_description[name] = descriptions[name]
    for name in output_names:
        if descriptions.get(name):
            mlmodel.output_description[name] = descriptions[name]
    mlmodel.short_description = summary
