"""One ExecuTorch program for a family of graphs that differ only in their own weights, plus one weight file each.

The experts of a split (mobile_moe/export/graphs.py, `Split.families`) share one structure: expert-paths' experts hold
the same attention, norms and head and differ in their MLPs; per-block's experts of one block differ in everything.
Lowering each from scratch costs E lowerings, and for expert-paths copies the shared weights into every expert's file.
Here the family is lowered ONCE, from a template whose own weights are random (so no two are equal), with those weights
tagged external: XNNPACK keeps them out of the program, in ExecuTorch named data (a .ptd file) keyed by the sha256
of their stored bytes. Each member's .ptd holds the member's weights under the template's keys, so `program +
member.ptd` runs that member, and the shared weights are stored once, in the program.

int8: activation quantization parameters live in the program, so a family shares them: one set of observers is
calibrated on every member's inputs with that member's weights loaded (min/max over the family). Weights are still
quantized per member, per channel, from the member's own values.

8da4w: activations are quantized as the graph runs, so only the weights differ; each member's are its own 4-bit
groups, stored as XNNPACK stores them (packed two to a byte, bfloat16 scales).

A family XNNPACK stores in a way we cannot map (a weight it transformed, or one it left inside the program) raises
NotShareable, and the caller exports the members one by one. Every member is run from its .ptd and compared with its
eager module before the family is accepted.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from mobile_moe.export.artifact import Artifact
from mobile_moe.export.executorch_backend import lower, quantizer
from mobile_moe.export.quiet import native_stderr_captured

WEIGHTS_TAG = "weights"
ALIGNMENT = 16  # XNNPACK's constant alignment (xnnpack_graph_serialize.CONSTANT_TENSOR_ALIGNMENT)
SCALE_PREFIX = "scale_"  # XNNPACK keys a per-channel scale "scale_" + sha256 of its bytes
# max |program - eager| / max |eager| for each member (int8, 8da4w: the kernels round otherwise than the eager ops)
TOLERANCE = {"none": 1e-4, "int8": 0.05, "8da4w": 0.05}

Inputs = tuple[Tensor, ...]


class _Lowered(NamedTuple):
    """A family lowered once: the program, its manifest details, the names of the weights that vary between members,
    the template's values of those (and the forms XNNPACK stores them in) and each member's, and each member's
    reference module (eager, or its eager quantized copy)."""

    program: Any
    details: dict[str, Any]
    varying: list[str]
    template_values: dict[str, Tensor]
    member_values: list[dict[str, Tensor]]
    references: list[nn.Module]


class NotShareable(Exception):
    """The family cannot be served by one program (the message says why): export its members one by one."""


def export_executorch_family(
    members: Sequence[nn.Module],
    example_inputs: Inputs,
    program_path: Path,
    weight_paths: Sequence[Path],
    *,
    quantize: str = "none",
    calibrations: Sequence[Sequence[Inputs]] = (),
) -> list[Artifact]:
    """Write one program for `members` at `program_path` and member i's weights at `weight_paths[i]`; an Artifact
    per member (the program, with its weight file). NotShareable if the family cannot share one program."""
    members = [member.eval() for member in members]
    calibrations = [list(c) or [example_inputs] for c in calibrations] or [[example_inputs]] * len(members)
    own = _own_weight_names(members)
    if not own:
        raise NotShareable("the members share every weight")
    template = _template(members[0], own)
    with torch.no_grad():
        if quantize == "8da4w":
            lowered = _lowered_8da4w(template, members, example_inputs)
        else:
            lowered = _lowered_from_graphs(template, members, own, example_inputs, calibrations, quantize)
    keys = _keys_of(lowered.program, lowered.template_values, lowered.varying)
    Path(program_path).write_bytes(lowered.program.buffer)
    for member_values, path in zip(lowered.member_values, weight_paths, strict=True):
        _write_weights(path, {key: member_values[target] for key, target in keys.items()})
    for reference, inputs, path in zip(lowered.references, calibrations, weight_paths, strict=True):
        _check_member(program_path, path, reference, inputs[0], TOLERANCE[quantize])
    details = {**lowered.details, "program_shared_by": len(members)}
    return [Artifact(Path(program_path), details, weights=Path(path)) for path in weight_paths]


def _lowered_from_graphs(template, members, own, example_inputs: Inputs, calibrations, quantize: str) -> _Lowered:
    """The family in fp32, or in int8 with one set of activation observers (_quantized_family)."""
    if quantize == "int8":
        template_graph, references = _quantized_family(template, members, own, example_inputs, calibrations)
        varying = _differing(template_graph, references[0])
        values = [_values(graph, varying) for graph in references]
    else:
        template_graph = torch.export.export(template, example_inputs).module()
        varying = [target for target in _get_attr_targets(template_graph) if target in own]
        states = [member.state_dict() for member in members]
        values = [{target: state[target] for target in varying} for state in states]
        references = list(members)
    program, details = lower(template_graph, example_inputs, tag=lambda target: target in varying)
    return _Lowered(program, details, varying, _values(template_graph, varying), values, references)


# --- the family's weights ------------------------------------------------------------------------------------------


def _own_weight_names(members: Sequence[nn.Module]) -> list[str]:
    """Names of the floating-point weights (parameters and buffers) that are not one tensor shared by every member."""
    states = [member.state_dict(keep_vars=True) for member in members]
    if any(state.keys() != states[0].keys() for state in states):
        raise NotShareable("the members' weights have different names")
    return [
        name
        for name, tensor in states[0].items()
        if tensor.is_floating_point() and any(state[name] is not tensor for state in states[1:])
    ]


def _template(member: nn.Module, own: list[str]) -> nn.Module:
    """A copy of `member` with random own weights (seeded): distinct values, so each has its own content hash."""
    template = copy.deepcopy(member)
    generator = torch.Generator().manual_seed(0)
    state = template.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in own:
            state[name].copy_(torch.randn(state[name].shape, generator=generator) * 0.05)
    return template


def _load_own(target: nn.Module, source: nn.Module, own: list[str]) -> None:
    state, values = target.state_dict(keep_vars=True), source.state_dict()
    with torch.no_grad():
        for name in own:
            state[name].copy_(values[name])


def _fetch(module: nn.Module, target: str) -> Tensor:
    value = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _get_attr_targets(graph: torch.fx.GraphModule) -> list[str]:
    nodes = graph.graph.nodes
    return [node.target for node in nodes if node.op == "get_attr" and isinstance(_fetch(graph, node.target), Tensor)]


def _values(graph: torch.fx.GraphModule, targets: list[str]) -> dict[str, Tensor]:
    """The tensors `targets` name in `graph`, plus what XNNPACK derives from them when it lowers (int8 biases)."""
    return {target: _fetch(graph, target) for target in targets} | _int8_biases(graph)


def _differing(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> list[str]:
    """get_attr targets whose tensors differ between two graphs of one structure."""
    return [target for target in _get_attr_targets(a) if not torch.equal(_fetch(a, target), _fetch(b, target))]


# --- int8 ------------------------------------------------------------------------------------------------------------


def _quantized_family(template, members, own, example_inputs, calibrations):
    """The template and every member quantized with ONE set of activation observers calibrated over the family."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    # The captured graph aliases the module it was exported from, and members' weights are loaded into it in turn:
    # capture a copy, never a member (that would overwrite the model's own weights).
    prepared = prepare_pt2e(torch.export.export(copy.deepcopy(template), example_inputs).module(), quantizer())
    for member, inputs in zip(members, calibrations, strict=True):
        _load_own(prepared, member, own)
        for batch in inputs:
            prepared(*batch)

    def quantized(source: nn.Module) -> torch.fx.GraphModule:
        _load_own(prepared, source, own)
        _reobserve_weights(prepared)
        return convert_pt2e(copy.deepcopy(prepared))

    return quantized(template), [quantized(member) for member in members]


def _int8_biases(graph: torch.fx.GraphModule) -> dict[str, Tensor]:
    """XNNPACK quantizes an int8 linear's fp32 bias itself when it lowers (QuantParams.from_bias): int32, per output
    channel, scale = weight scale * input scale. {"BIAS#int32": that bias, "BIAS#scale": its scale} per bias."""
    derived = {}
    ops = torch.ops.quantized_decomposed
    for node in graph.graph.nodes:
        if node.target != torch.ops.aten.linear.default or len(node.args) < 3 or node.args[2] is None:
            continue
        inputs, weights, bias = node.args[:3]
        if inputs.target != ops.dequantize_per_tensor.default or weights.target != ops.dequantize_per_channel.default:
            continue
        scale = _fetch(graph, weights.args[1].target) * float(inputs.args[1])
        value = _fetch(graph, bias.target)
        zero = torch.zeros_like(scale, dtype=torch.int64)
        derived[f"{bias.target}#int32"] = ops.quantize_per_channel(
            value, scale, zero, 0, -(2**31), 2**31 - 1, torch.int32
        )
        derived[f"{bias.target}#scale"] = scale
    return derived


def _reobserve_weights(prepared: torch.fx.GraphModule) -> None:
    """Reset each weight observer (one reading a get_attr) and show it the weight now loaded: a member's weights are
    quantized from its own range, not the family's."""
    for node in prepared.graph.nodes:
        if node.op == "call_module" and node.args and getattr(node.args[0], "op", None) == "get_attr":
            observer = prepared.get_submodule(node.target)
            observer.reset_min_max_vals()
            observer(_fetch(prepared, node.args[0].target))


# --- 8da4w ----------------------------------------------------------------------------------------------------------


def _lowered_8da4w(template: nn.Module, members: Sequence[nn.Module], example_inputs: Inputs) -> _Lowered:
    """The family in 8da4w (each module quantized from its own weights; nothing to calibrate; the references are the
    members' eager quantized copies). Exporting unwraps torchao's weight tensor into its int8 data, fp32 group scales
    and zero points (`...parametrizations.weight.original0..2`); the tensors that differ between the template and a
    member are the ones tagged, and with them what XNNPACK stores instead (_qc4w_forms)."""
    from mobile_moe.export.executorch_backend import quantize_8da4w

    quantized = [quantize_8da4w(member) for member in members]
    template = quantize_8da4w(template)
    template_state = _unwrapped_state(template, example_inputs)
    states = [_unwrapped_state(member, example_inputs) for member in quantized]
    varying = [name for name, value in template_state.items() if not torch.equal(value, states[0][name])]
    program, details = lower(template, example_inputs, tag=lambda name: name in varying, rewrites_only=True)
    template_forms, *member_forms = [_qc4w_forms({name: state[name] for name in varying})
                                     for state in [template_state, *states]]  # fmt: skip
    return _Lowered(program, details, varying, template_forms, member_forms, quantized)


def _unwrapped_state(module: nn.Module, example_inputs: Inputs) -> dict[str, Tensor]:
    """The tensors `lower` sees once it has decomposed `module`'s graph, by their names there."""
    from mobile_moe.export.decompositions import xnnpack_rewrites

    program = torch.export.export(module, example_inputs).run_decompositions(xnnpack_rewrites())
    return {**program.state_dict, **program.constants}


def _qc4w_forms(values: dict[str, Tensor]) -> dict[str, Tensor]:
    """`values` plus the forms XNNPACK stores a 4-bit grouped weight in (node_visitor.py, get_serialized_buffer_index
    and get_quant_params, executorch 1.5.1): its int8 data packed two to a byte by XNNPACK's own convert_to_qc4w, and
    its group scales in bfloat16. Every int8 matrix in [-8, 7] and every float tensor gets its form; _keys_of keeps
    those the program names."""
    from executorch.backends.xnnpack.operators.node_visitor import NodeVisitor

    forms = dict(values)
    for name, value in values.items():
        if value.dtype == torch.int8 and value.ndim == 2 and value.numel() and -8 <= value.min() <= value.max() <= 7:
            forms[f"{name}#qc4w"] = NodeVisitor.convert_to_qc4w(value.contiguous())
        elif value.is_floating_point():
            forms[f"{name}#bf16"] = value.to(torch.bfloat16)
    return forms


# --- keys and weight files -----------------------------------------------------------------------------------------


def _raw(tensor: Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _keys_of(program, template_values: dict[str, Tensor], varying: list[str]) -> dict[str, str]:
    """{named-data key: name in `template_values`} for the weights the program keeps outside; NotShareable unless
    every key is one of those values' bytes and every varying weight (or what XNNPACK derives from it) is outside."""
    from executorch.exir._serialize._cord import Cord
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    if WEIGHTS_TAG not in (program._tensor_data or {}):
        raise NotShareable("XNNPACK kept none of the members' own weights outside the program")
    payload = FlatTensorSerializer().deserialize(Cord(bytes(program._tensor_data[WEIGHTS_TAG])))
    by_hash = {hashlib.sha256(_raw(value)).hexdigest(): target for target, value in template_values.items()}
    keys = {}
    for key in payload.named_data:
        target = by_hash.get(key.removeprefix(SCALE_PREFIX))
        if target is None:
            raise NotShareable(f"XNNPACK stores a weight ({key[:16]}...) as bytes that are none of the members'")
        keys[key] = target
    missing = set(varying) - {name.split("#")[0] for name in keys.values()}
    if missing:
        raise NotShareable(f"{len(missing)} own weights stayed inside the program (e.g. {sorted(missing)[0]})")
    return keys


def _write_weights(path: Path, named: dict[str, Tensor]) -> None:
    """An ExecuTorch .ptd (FlatTensor) holding `named` raw tensors under their keys."""
    from executorch.exir._serialize.data_serializer import DataEntry, DataPayload
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    keys = sorted(named)
    payload = DataPayload(
        buffers=[_raw(named[key]) for key in keys],
        named_data={key: DataEntry(i, ALIGNMENT, tensor_layout=None) for i, key in enumerate(keys)},
    )
    with open(path, "wb") as handle:
        FlatTensorSerializer().serialize(payload).write_to_file(handle)


@torch.no_grad()
def _check_member(program_path: Path, weights_path: Path, reference: nn.Module, inputs: Inputs, tolerance: float):
    """The member's program + weights must compute what its eager (or reference quantized) module computes."""
    from executorch.runtime import Runtime

    with native_stderr_captured():  # ExecuTorch's own lines (its cpuinfo probe at the first XNNPACK load)
        method = Runtime.get().load_program(str(program_path), data_path=str(weights_path)).load_method("forward")
        got = method.execute([x.contiguous() for x in inputs])
    want = reference(*inputs)
    want = want if isinstance(want, (tuple, list)) else (want,)
    for g, w in zip(got, want, strict=True):
        error = float((g - w).abs().max()) / max(float(w.abs().max()), 1e-6)
        if error > tolerance:
            raise NotShareable(f"{weights_path.name} runs {error:.1e} from its eager module (tolerance {tolerance})")
