"""ExecuTorch exporter: torch.export -> XNNPACK-friendly rewrites -> XnnpackPartitioner -> to_executorch -> .pte.

int8: torchao's pt2e flow with ExecuTorch's XNNPACKQuantizer (symmetric, per-channel weights, static activations),
calibrated on the inputs the graph really sees; the quantized graph is exported again and lowered the same way.

8da4w: every Linear's weights in 4 bits, symmetric, one scale per group of 32 inputs, activations quantized to int8
per token as the graph runs (torchao's Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
weight_granularity=PerGroup(32)), the scheme ExecuTorch's own LLM exports use); nothing to calibrate. Its graph is
decomposed with our XNNPACK rewrites alone, not torch.export's whole default table first: that table breaks torchao's
quantize / dequantize ops into primitives XNNPACK no longer recognises (the program came out larger than fp32 and
computing another function), while to_edge_transform_and_lower keeps the ops its partitioner claims.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from mobile_moe.export.artifact import Artifact
from mobile_moe.export.decompositions import xnnpack_decompositions, xnnpack_rewrites
from mobile_moe.export.quantization import GROUP

SUFFIX = ".pte"


def quantizer():
    """XNNPACK's int8 scheme: symmetric, per-channel weights, static activations."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    return XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))


def quantize_8da4w(module: nn.Module) -> nn.Module:
    """A copy of `module` with 4-bit grouped weights and int8 dynamic activations in every Linear (see above)."""
    import copy

    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    quantized = copy.deepcopy(module)
    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(GROUP))
    quantize_(quantized, config)
    return quantized


def quantize_pt2e(module: nn.Module, example_inputs: tuple[Tensor, ...], calibration: Sequence[tuple[Tensor, ...]]):
    """The module with int8 weights and activations (XNNPACK's scheme), observers calibrated on `calibration`."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    captured = torch.export.export(module, example_inputs).module()
    prepared = prepare_pt2e(captured, quantizer())
    with torch.no_grad():
        for inputs in calibration or [example_inputs]:
            prepared(*inputs)
    return convert_pt2e(prepared)


# Ops we leave to ExecuTorch's portable kernels on purpose (see decompositions.py: lowering LayerNorm into XNNPACK
# ops broke parity on trained weights).
PORTABLE_BY_DESIGN = frozenset({"aten.native_layer_norm.default"})


def undelegated_ops(edge_program) -> list[str]:
    """Names of the ops left outside the XNNPACK delegate (they would run on ExecuTorch's portable kernels)."""
    ops = []
    for node in edge_program.graph_module.graph.nodes:
        if node.op != "call_function" or "getitem" in str(node.target) or "call_delegate" in str(node.target):
            continue
        # Edge ops print as "<EdgeOpOverload: aten.topk.default>: schema = ..."; keep "aten.topk.default".
        match = re.search(r"<EdgeOpOverload: ([\w.]+)>", str(node.target))
        ops.append(match.group(1) if match else str(node.target))
    return ops


def lower(
    module: nn.Module,
    example_inputs: tuple[Tensor, ...],
    tag: Callable[[str], bool] | None = None,
    *,
    rewrites_only: bool = False,
):
    """(ExecuTorch program, details for the manifest) for `module` lowered to XNNPACK. `tag(name)`: weights (get_attr
    names in the module) that XNNPACK keeps outside the program, in the "weights" data file. `rewrites_only`: our
    XNNPACK rewrites without torch.export's default decompositions (8da4w graphs: see the module docstring)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = torch.export.export(module, example_inputs)
    if tag is not None:
        _tag_weights(program, tag)
    program = program.run_decompositions(xnnpack_rewrites() if rewrites_only else xnnpack_decompositions())
    if tag is not None:  # again: decomposing unwraps a quantized weight (8da4w's) into tensors of their own
        _tag_weights(program, tag)
    mutated = sorted(program.graph_signature.buffers_to_mutate.values())  # listed once the graph is functional
    if mutated:  # the native runner lets a bundle's graphs share planned memory (graph_loader.h PlannedArenas)
        name = type(module).__name__
        raise ValueError(f"{name} mutates buffers {mutated} when it runs: a bundle's graphs hold no state")
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    leftover = undelegated_ops(edge.exported_program())
    delegates = sum(1 for n in edge.exported_program().graph_module.graph.nodes if "call_delegate" in str(n.target))
    return edge.to_executorch(), {"delegate": "xnnpack", "delegates": delegates, "undelegated_ops": leftover}


def _tag_weights(program, tag: Callable[[str], bool]) -> None:
    """Mark the weights `tag` names (by their name in the module: parameter, buffer or pt2e's folded constant) so
    XNNPACK keeps them outside the program, in the "weights" data file."""
    signature = program.graph_signature
    names = {
        **signature.inputs_to_parameters,
        **signature.inputs_to_buffers,
        **signature.inputs_to_lifted_tensor_constants,
    }
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in names and tag(names[node.name]):
            node.meta.setdefault("custom", {})["delegate_constant_tag"] = "weights"


def export_executorch(
    module: nn.Module,
    example_inputs: tuple[Tensor, ...],
    out_path: str | Path,
    *,
    quantize: str = "none",
    calibration: Sequence[tuple[Tensor, ...]] = (),
    **_: object,
) -> Artifact:
    module = module.eval()
    with torch.no_grad():
        if quantize == "int8":
            module = quantize_pt2e(module, example_inputs, calibration)
        elif quantize == "8da4w":
            module = quantize_8da4w(module)
        program, details = lower(module, example_inputs, rewrites_only=quantize == "8da4w")
    Path(out_path).write_bytes(program.buffer)
    return Artifact(Path(out_path), details)
