"""The bundle manifest's schema, written once: field types and ranges, and the rules that tie fields together.

`Manifest` is the one Python model of a bundle's manifest: export builds it, `validate_manifest` (which
export.manifest.read_manifest calls) returns it, and every consumer reads its attributes and methods: predict, the
Python runtime, bench, the push to a phone, and the export itself before it moves a bundle into place. The native runner
cannot import this and range-checks the same values itself (libmobile_moe/src/bundle_manifest.cpp); the
fault-injection tests drive one table of manifest mutations through both.

Layouts and the graphs they need (mobile_moe/export/graphs.py writes them):
  dense         one graph, role "dense": images -> logits.                                num_experts = top_k = 0
  monolithic    one graph, role "monolithic": images -> logits, router_probs (1, E).       1 <= top_k <= E
  expert-paths  "router": images -> tokens, router_probs; "expert" e: tokens, gate -> logits.   top_k = 1
                Early routing (a Mobile V-MoE's router_block) adds composition.trunk_tail, a "trunk_tail" graph:
                tokens -> tokens (the dense blocks after the router), run between the router and the expert.
  per-block     "router"; per MoE block "block_shared": tokens -> residual, normed, and one "block_expert" per
                expert: normed -> delta; "head": tokens -> logits.                          1 <= top_k <= E
  whole         one graph, role "whole": images -> logits, expert_tokens (1, G, E): a per-token MoE, every expert
                inside; expert_tokens[g, e] > 0 says the image used expert e of expert set g (G >= 1: one set per
                MoE block owning experts).                                              0 <= top_k <= E (per token)

What an image touches (routing and params_active_max always; the top-1s when the bundle comes from a run):
  routing            the model's routing kind (mobile_moe config): none -> dense; image -> expert-paths, per-block or
                     monolithic; cluster -> expert-paths or monolithic; token, expert, soft -> whole.
  params_active_max  the most parameters one image computes with (mobile_moe.models.costs' params_active, worst
                     case). It can never exceed what the graphs one image needs hold (`params_loaded_max`): the
                     router and shared graphs plus its top_k heaviest experts, or the one graph of a single-graph
                     layout.
  validation_top1    the exported run's validation top-1 (its best.pt, 0..1), when the bundle comes from a run.
  test_top1          the exported checkpoint's top-1 on its data's test split (0..1), measured by export on the eager
                     model as `evaluate` measures it, when the bundle comes from a run whose data has one: the one
                     accuracy bench reports compare models with (validation_top1 where it is absent, and they say so).
How an image file becomes the input tensor:
  input.resize       the eval resize policy evaluation used (mobile_moe/preprocess.py, which predict applies), then
                     scale to [0, 1] and input.mean/std:
                       {"policy": "stretch"}: both sides to S, the aspect ratio not kept;
                       {"policy": "resize-center-crop", "resize_to": R, "crop_to": S}: the shorter side to R >= S
                       (aspect ratio kept), then the centre S x S square.
                     `origin` says where the policy came from: "run" (the run's config.json recorded it) or
                     "assumed" (exported without a run: stretch). Strict: a known policy, no unknown keys, sizes
                     positive integers, crop_to = S.
Each graph's `params` counts the weights it carries: parameters and buffers (Hard MoE's centroids).
Graphs sharing one program (ExecuTorch, mobile_moe/export/executorch_family.py): several graphs name the same `file`
(the program, with the weights they share) and each its own `weights` ({file, sha256, bytes}: a .ptd holding the weights
only it has); loading the graph loads both. `bytes` is the program's size; GraphEntry.load_bytes adds the two.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mobile_moe.preprocess import INTERPOLATIONS, POLICIES, ResizePolicy
from mobile_moe.utils.class_names import class_names_problem

FORMAT = "mobile-moe-bundle"
VERSION = 2
MANIFEST = "manifest.json"  # the manifest's file name in a bundle
MAX_MANIFEST_BYTES = 64 << 20  # a real manifest is kilobytes; refuse to parse anything absurd
BACKENDS = ("executorch", "onnx", "coreml")
LAYOUTS = ("dense", "monolithic", "expert-paths", "per-block", "whole")
SPLIT_LAYOUTS = ("expert-paths", "per-block")  # what export --layout chooses between, for a per-image MoE
ROLES = ("router", "trunk_tail", "expert", "block_shared", "block_expert", "head", "monolithic", "dense", "whole")
LAYOUTS_OF_ROUTING = {
    "none": ("dense",),
    "image": ("expert-paths", "per-block", "monolithic"),
    "cluster": ("expert-paths", "monolithic"),
    "token": ("whole",),
    "expert": ("whole",),
    "soft": ("whole",),
}
ROUTINGS = tuple(LAYOUTS_OF_ROUTING)
RESIZE_ORIGINS = ("run", "assumed")
# What a runner does with each layout (the native runner's Bundle::kind): a router and experts, or one graph.
KIND_OF_LAYOUT = {
    "expert-paths": "split",
    "per-block": "split",
    "dense": "dense",
    "monolithic": "monolithic",
    "whole": "whole",
}

# Bounds that keep every consumer's arithmetic in range (the native runner allocates from these numbers).
MAX_EXPERTS = 4096
MAX_DIM = 1 << 16  # one tensor dimension
MAX_ELEMENTS = 1 << 28  # one tensor (1 GiB of float32)
MAX_CLASSES = 1 << 20

MAX_COUNT = 1 << 62  # bytes, parameters
MAX_GRAPHS = 1 << 16
MAX_NAME = 256  # a name: the model's, a graph's, a tensor's
MAX_PATH = 4096  # a file's path inside the bundle
MAX_LABEL = 1024  # a class or super-class name
MAX_RANK = 8  # a tensor's dimensions
MAX_TENSORS = 16  # a graph's inputs, or its outputs
MAX_BLOCK = 4096  # a per-block graph's block index
MAX_CHANNELS = 4  # an input image's channels
TENSOR_DTYPE = "float32"  # every tensor a bundle's graphs take and give, the input included

Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Dim = Annotated[int, Field(ge=1, le=MAX_DIM)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    # strict: 1.5, "5" and true are not integers; extra keys are kept (newer exporters may add facts).
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


class TensorSpec(_Strict):
    name: Name
    shape: Annotated[list[Dim], Field(min_length=1, max_length=MAX_RANK)]
    dtype: Literal[TENSOR_DTYPE]  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _bounded(self) -> TensorSpec:
        if math.prod(self.shape) > MAX_ELEMENTS:
            raise ValueError(f"shape {self.shape} has more than {MAX_ELEMENTS} elements")
        return self


class ResizeSpec(ResizePolicy):
    """input.resize: the policy's own rules (strict, no unknown keys) and where it came from."""

    origin: Literal[RESIZE_ORIGINS] | None = None  # type: ignore[valid-type]


class InputSpec(_Strict):
    shape: Annotated[list[Dim], Field(min_length=4, max_length=4)]  # (1, C, S, S)
    dtype: Literal[TENSOR_DTYPE]  # type: ignore[valid-type]
    mean: list[FiniteFloat]
    std: list[Annotated[float, Field(gt=0, allow_inf_nan=False)]]
    resize: ResizeSpec

    @model_validator(mode="after")
    def _consistent(self) -> InputSpec:
        batch, channels, height, width = self.shape
        if batch != 1 or channels > MAX_CHANNELS or height != width:
            raise ValueError(f"shape {self.shape} must be (1, C, S, S) with C <= {MAX_CHANNELS}")
        if len(self.mean) != channels or len(self.std) != channels:
            raise ValueError(f"mean and std need {channels} values (one per channel)")
        if self.resize.crop_to not in (None, height):
            raise ValueError(f"resize.crop_to {self.resize.crop_to} must be the input size {height}")
        return self


class ModelSummary(_Strict):
    """The parts of the model config that consumers read; the rest is kept as written."""

    name: Name
    image_size: Dim
    in_chans: Annotated[int, Field(ge=1, le=MAX_CHANNELS)]
    num_classes: Annotated[int, Field(ge=1, le=MAX_CLASSES)]
    renormalize_gates: bool = False


class GraphFile(_Strict):
    """A file a graph loads, relative to the bundle, with its size and sha256: a graph's program, or the ExecuTorch
    named-data file (.ptd) holding the weights it keeps outside its program (GraphEntry.weights)."""

    file: Annotated[str, Field(min_length=1, max_length=MAX_PATH)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    bytes: Count


class GraphEntry(_Strict):
    name: Name
    role: Literal[ROLES]  # type: ignore[valid-type]
    expert: Annotated[int, Field(ge=0, lt=MAX_EXPERTS)] | None
    block: Annotated[int, Field(ge=0, le=MAX_BLOCK)] | None = None
    file: Annotated[str, Field(min_length=1, max_length=MAX_PATH)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    bytes: Count
    params: Count
    inputs: Annotated[list[TensorSpec], Field(min_length=1, max_length=MAX_TENSORS)]
    outputs: Annotated[list[TensorSpec], Field(min_length=1, max_length=MAX_TENSORS)]
    weights: GraphFile | None = None  # ExecuTorch: this graph's own weights, when graphs share one program

    def output(self, name: str) -> TensorSpec | None:
        return next((spec for spec in self.outputs if spec.name == name), None)

    def files(self) -> list[GraphFile]:
        """The files loading this graph reads: its program, then its weights file if it has one."""
        program = GraphFile(file=self.file, sha256=self.sha256, bytes=self.bytes)
        return [program] if self.weights is None else [program, self.weights]

    @property
    def load_bytes(self) -> int:
        """Bytes read to load this graph: its program plus its own weights file."""
        return sum(file.bytes for file in self.files())

    @property
    def loads_per_expert(self) -> bool:
        """Whether this graph loads only for the images that pick its expert (one expert path, or its MLP in one
        block); every other graph (router, shared block halves, head, a single-graph layout's one) loads for all."""
        return self.role in ("expert", "block_expert") and self.expert is not None


class BlockGraphs(_Strict):
    """A per-block layout's MoE block: its shared graph and one graph per expert."""

    shared: Name
    experts: list[Name]


class Composition(_Strict):
    layout: Literal[LAYOUTS]  # type: ignore[valid-type]
    router: Name | None = None
    experts: list[Name] | None = None  # expert-paths: expert e's graph
    trunk_tail: Name | None = None  # expert-paths with early routing: the dense blocks after the router
    blocks: list[BlockGraphs] | None = None  # per-block
    head: Name | None = None  # per-block


Fraction = Annotated[float, Field(ge=0, le=1)]


class QuantizedAccuracy(_Strict):
    """What export measured of a quantized bundle itself on validation images, against the fp32 model on the same
    images; or, with measured false, why it measured nothing (a reason: no validation split, Core ML off macOS)."""

    measured: bool = True
    reason: Annotated[str, Field(max_length=1024)] | None = None
    images: Count | None = None
    fp32_top1: Fraction | None = None
    quantized_top1: Fraction | None = None
    top1_change: Annotated[float, Field(ge=-1, le=1)] | None = None
    prediction_agreement: Fraction | None = None

    @model_validator(mode="after")
    def _measured_has_numbers(self) -> QuantizedAccuracy:
        numbers = (self.images, self.fp32_top1, self.quantized_top1, self.top1_change, self.prediction_agreement)
        if self.measured and any(number is None for number in numbers):
            raise ValueError("a measured validation needs images, fp32_top1, quantized_top1, top1_change and "
                             "prediction_agreement")  # fmt: skip
        return self


class QuantizationReport(_Strict):
    """What export says of a quantized bundle (method, bytes, note: for people) and its measured accuracy."""

    validation: QuantizedAccuracy | None = None


class Manifest(_Strict):
    format: Literal[FORMAT]  # type: ignore[valid-type]
    version: Literal[VERSION]  # type: ignore[valid-type]
    backend: Literal[BACKENDS]  # type: ignore[valid-type]
    model: ModelSummary
    num_experts: Annotated[int, Field(ge=0, le=MAX_EXPERTS)]
    top_k: Annotated[int, Field(ge=0, le=MAX_EXPERTS)]
    routing: Literal[ROUTINGS]  # type: ignore[valid-type]
    params_active_max: Count
    input: InputSpec
    class_names: list[Annotated[str, Field(max_length=MAX_LABEL)]]
    super_class_names: list[Annotated[str, Field(max_length=MAX_LABEL)]] | None = None
    composition: Composition
    graphs: Annotated[list[GraphEntry], Field(min_length=1, max_length=MAX_GRAPHS)]
    # What export measured and chose, for people and reports (no consumer's arithmetic depends on them):
    sizes: dict[str, Count] | None = None  # Manifest.phone_sizes(): total, resident, + one expert
    precision: str | None = None  # fp32, fp16, or the int8 / compression method
    source: str | None = None  # the run directory exported
    validation_top1: Annotated[float, Field(ge=0, le=1)] | None = None
    test_top1: Annotated[float, Field(ge=0, le=1)] | None = None
    parity: dict[str, Any] | None = None  # bundle vs eager model on sample images, at export
    quantization: QuantizationReport | None = None  # any quantized part: bytes and the validation top-1 change

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Manifest:
        _check_input_and_classes(self)
        _check_weights(self)
        graphs = _graphs_by_name(self.graphs)
        layout = self.composition.layout
        if self.composition.trunk_tail is not None and layout != "expert-paths":
            raise ValueError(f"composition.trunk_tail: only an expert-paths bundle has one, not {layout}")
        CHECKS[self.composition.layout](self, graphs)
        _check_routing(self)
        _check_params_active(self)
        return self

    @property
    def kind(self) -> str:
        """ "split" (router + experts), "dense", "monolithic" (a per-image MoE in one graph) or "whole" (a per-token
        MoE, which exports only as one graph): what a runner does with the layout (the native runner's too)."""
        return KIND_OF_LAYOUT[self.composition.layout]

    def graph(self, name: str) -> GraphEntry:
        return next(graph for graph in self.graphs if graph.name == name)

    def resident_and_per_expert(self, size: Callable[[GraphEntry], int]) -> tuple[int, dict[int, int]]:
        """(what every image loads, {expert: what choosing it adds}), each the sum of `size(graph)` (bytes loaded,
        parameters) over its graphs (GraphEntry.loads_per_expert). The one reading of that rule: the params bound
        below, export's sizes, and bench's bytes and parameters per image."""
        resident, per_expert = 0, {}
        for graph in self.graphs:
            if graph.loads_per_expert:
                per_expert[graph.expert] = per_expert.get(graph.expert, 0) + size(graph)
            else:
                resident += size(graph)
        return resident, per_expert

    def params_loaded_max(self) -> int:
        """Parameters held by the graphs one image needs at most: the router and shared graphs (or the one graph of
        a single-graph layout) plus the top_k experts whose graphs hold the most."""
        resident, per_expert = self.resident_and_per_expert(lambda graph: graph.params)
        return resident + sum(sorted(per_expert.values(), reverse=True)[: self.top_k])

    def bundle_bytes(self) -> int:
        """Bytes on disk of the bundle's graph files, a program that graphs share counted once."""
        return sum({file.file: file.bytes for graph in self.graphs for file in graph.files()}.values())

    def phone_sizes(self) -> dict[str, int]:
        """Bytes a phone holds (the manifest's `sizes`): everything (a shared program once), what every image loads
        (router and shared parts), and that plus the largest expert (its program and weights: what loading it
        reads)."""
        total = self.bundle_bytes()
        resident, per_expert = self.resident_and_per_expert(lambda graph: graph.load_bytes)
        sizes = {"total_bytes": total, "resident_bytes": resident if per_expert else total}
        if per_expert:
            sizes["max_expert_bytes"] = max(per_expert.values())
            sizes["resident_plus_one_expert_bytes"] = resident + max(per_expert.values())
        return sizes

    def updated(self, **fields: Any) -> Manifest:
        """This manifest with `fields` set, validated again (the writer fills graphs, sizes and parity in turn)."""
        return validate_manifest({**self.to_json(), **fields})

    def to_json(self) -> dict[str, Any]:
        """The manifest as written: the fields it was given (none added as null), extras included."""
        return self.model_dump(mode="json", exclude_unset=True)


# --- cross-field rules ------------------------------------------------------------------------------------------------


def _check_input_and_classes(m: Manifest) -> None:
    expected = [1, m.model.in_chans, m.model.image_size, m.model.image_size]
    if m.input.shape != expected:
        raise ValueError(f"input.shape {m.input.shape} differs from the model's {expected}")
    if len(m.class_names) != m.model.num_classes:
        raise ValueError(f"{len(m.class_names)} class_names for a model with {m.model.num_classes} classes")
    problem = class_names_problem(m.class_names)  # the one rule for a list of class names
    if problem is not None:
        raise ValueError(f"class_names: {problem}")


def _check_weights(m: Manifest) -> None:
    for graph in m.graphs:
        if graph.weights is not None and m.backend != "executorch":
            raise ValueError(f"graph {graph.name!r} has a weights file: only ExecuTorch programs load one")
        if graph.weights is not None and graph.weights.file == graph.file:
            raise ValueError(f"graph {graph.name!r}: its weights file is its program file")


def _graphs_by_name(entries: list[GraphEntry]) -> dict[str, GraphEntry]:
    graphs: dict[str, GraphEntry] = {}
    for entry in entries:
        if entry.name in graphs:
            raise ValueError(f"two graphs are named {entry.name!r}")
        graphs[entry.name] = entry
    return graphs


def _named(graphs: dict[str, GraphEntry], name: str | None, role: str, what: str) -> GraphEntry:
    if name is None or name not in graphs:
        raise ValueError(f"composition.{what} names graph {name!r}, which is not in graphs")
    if graphs[name].role != role:
        raise ValueError(f"graph {name!r} ({what}) has role {graphs[name].role!r}, expected {role!r}")
    return graphs[name]


def _shape(spec: TensorSpec | None) -> list[int] | None:
    return None if spec is None else spec.shape


def _expect(graph: GraphEntry, actual: list[int] | None, expected: list[int], what: str) -> None:
    if actual != expected:
        raise ValueError(f"graph {graph.name!r}: {what} shape {actual} must be {expected}")


def _check_experts_and_k(m: Manifest, k_max: int, k_min: int = 1) -> None:
    if m.num_experts < 1:
        raise ValueError(f"num_experts {m.num_experts}: an MoE bundle needs at least 1")
    if m.model.model_extra and m.model.model_extra.get("num_experts") not in (None, m.num_experts):
        raise ValueError(f"num_experts {m.num_experts} differs from the model's {m.model.model_extra['num_experts']}")
    if not k_min <= m.top_k <= k_max:
        raise ValueError(f"top_k {m.top_k} must be between {k_min} and {k_max} for the {m.composition.layout} layout")


def _check_single(m: Manifest, graphs: dict[str, GraphEntry]) -> None:
    layout = m.composition.layout
    if len(graphs) != 1 or m.graphs[0].role != layout:
        raise ValueError(f"a {layout} bundle holds exactly one graph with role {layout!r}")
    graph = m.graphs[0]
    _expect(graph, [spec.shape for spec in graph.inputs], [m.input.shape], "input")  # one input: the image
    _expect(graph, _shape(graph.output("logits")), [1, m.model.num_classes], "logits")
    if layout == "dense":
        if m.num_experts != 0 or m.top_k != 0:
            raise ValueError("a dense bundle has num_experts 0 and top_k 0")
        return
    # A per-token MoE's top_k is per token (Experts Choice and Soft MoE have none: 0); the runtime picks nothing.
    _check_experts_and_k(m, m.num_experts, k_min=0 if layout == "whole" else 1)
    if layout == "monolithic":
        _expect(graph, _shape(graph.output("router_probs")), [1, m.num_experts], "router_probs")
        return
    tokens = graph.output("expert_tokens")
    sets = tokens.shape[1] if tokens is not None and len(tokens.shape) == 3 else 1
    _expect(graph, _shape(tokens), [1, sets, m.num_experts], "expert_tokens")


def _check_router(m: Manifest, graphs: dict[str, GraphEntry]) -> GraphEntry:
    router = _named(graphs, m.composition.router, "router", "router")
    _expect(router, router.inputs[0].shape, m.input.shape, "input")
    _expect(router, _shape(router.output("router_probs")), [1, m.num_experts], "router_probs")
    tokens = router.output("tokens")
    if tokens is None or len(tokens.shape) != 3:
        raise ValueError(f"graph {router.name!r} needs a tokens output of shape (1, T, D)")
    return router


def _check_expert_paths(m: Manifest, graphs: dict[str, GraphEntry]) -> None:
    _check_experts_and_k(m, 1)
    tokens = _check_router(m, graphs).output("tokens").shape
    if m.composition.trunk_tail is not None:
        tail = _named(graphs, m.composition.trunk_tail, "trunk_tail", "trunk_tail")
        _expect(tail, [spec.shape for spec in tail.inputs], [tokens], "input")
        _expect(tail, [spec.shape for spec in tail.outputs], [tokens], "output")
    names = m.composition.experts or []
    if len(names) != m.num_experts:
        raise ValueError(f"composition.experts names {len(names)} graphs for {m.num_experts} experts")
    for index, name in enumerate(names):
        expert = _named(graphs, name, "expert", f"experts[{index}]")
        if expert.expert != index:
            raise ValueError(f"graph {name!r} is listed as expert {index} but says expert {expert.expert}")
        _expect(expert, [spec.shape for spec in expert.inputs], [tokens, [1, 1]], "input")
        _expect(expert, _shape(expert.output("logits")), [1, m.model.num_classes], "logits")


def _check_per_block(m: Manifest, graphs: dict[str, GraphEntry]) -> None:
    _check_experts_and_k(m, m.num_experts)
    tokens = _check_router(m, graphs).output("tokens").shape
    if not m.composition.blocks:
        raise ValueError("a per-block bundle needs composition.blocks")
    for block_index, block in enumerate(m.composition.blocks):
        shared = _named(graphs, block.shared, "block_shared", f"blocks[{block_index}].shared")
        _expect(shared, [spec.shape for spec in shared.inputs], [tokens], "input")
        _expect(shared, [spec.shape for spec in shared.outputs], [tokens, tokens], "output")
        if len(block.experts) != m.num_experts:
            named = len(block.experts)
            raise ValueError(f"composition.blocks[{block_index}] names {named} experts, not {m.num_experts}")
        for index, name in enumerate(block.experts):
            expert = _named(graphs, name, "block_expert", f"blocks[{block_index}].experts[{index}]")
            if expert.expert != index:
                raise ValueError(f"graph {name!r} is listed as expert {index} but says expert {expert.expert}")
            _expect(expert, [spec.shape for spec in expert.inputs], [tokens], "input")
            _expect(expert, [spec.shape for spec in expert.outputs], [tokens], "output")
    head = _named(graphs, m.composition.head, "head", "head")
    _expect(head, [spec.shape for spec in head.inputs], [tokens], "input")
    _expect(head, _shape(head.output("logits")), [1, m.model.num_classes], "logits")


def _check_routing(m: Manifest) -> None:
    if m.composition.layout not in LAYOUTS_OF_ROUTING[m.routing]:
        allowed = " or ".join(LAYOUTS_OF_ROUTING[m.routing])
        raise ValueError(f"a model routing by {m.routing!r} exports as {allowed}, not {m.composition.layout}")


def _check_params_active(m: Manifest) -> None:
    if m.params_active_max > m.params_loaded_max():
        raise ValueError(
            f"params_active_max {m.params_active_max} is more than the {m.params_loaded_max()} parameters the "
            "graphs of one image hold"
        )


CHECKS = {
    "dense": _check_single,
    "monolithic": _check_single,
    "whole": _check_single,
    "expert-paths": _check_expert_paths,
    "per-block": _check_per_block,
}


# --- the one entry point ----------------------------------------------------------------------------------------------


def validate_manifest(data: Any) -> Manifest:
    """The parsed manifest, or ValueError with ONE line: where in the manifest, and what is wrong."""
    try:
        return Manifest.model_validate(data)
    except ValidationError as error:
        first = error.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "manifest"
        message = first["msg"].removeprefix("Value error, ")
        more = f" (and {error.error_count() - 1} more problems)" if error.error_count() > 1 else ""
        raise ValueError(f"{where}: {message}{more}") from None


# What JSON Schema can say of the cross-field rules: per layout, the experts and top_k it allows (_check_single,
# _check_experts_and_k) and the composition entries it needs (_check_expert_paths, _check_per_block).
LAYOUT_RULES: dict[str, dict[str, Any]] = {
    "dense": {"num_experts": {"const": 0}, "top_k": {"const": 0}},
    "monolithic": {"num_experts": {"minimum": 1}, "top_k": {"minimum": 1}},
    "whole": {"num_experts": {"minimum": 1}},
    "expert-paths": {"num_experts": {"minimum": 1}, "top_k": {"const": 1}, "required": ["router", "experts"]},
    "per-block": {"num_experts": {"minimum": 1}, "top_k": {"minimum": 1}, "required": ["router", "blocks", "head"]},
}


def _layout_rule(layout: str, rule: dict[str, Any]) -> dict[str, Any]:
    composition: dict[str, Any] = {"properties": {"layout": {"const": layout}}, "required": ["layout"]}
    then: dict[str, Any] = {"properties": {key: value for key, value in rule.items() if key != "required"}}
    if "required" in rule:
        then["properties"]["composition"] = {"required": rule["required"]}
    return {"if": {"properties": {"composition": composition}, "required": ["composition"]}, "then": then}


def _routing_rule(routing: str, layouts: tuple[str, ...]) -> dict[str, Any]:
    return {
        "if": {"properties": {"routing": {"const": routing}}, "required": ["routing"]},
        "then": {"properties": {"composition": {"properties": {"layout": {"enum": list(layouts)}}}}},
    }


def json_schema() -> dict[str, Any]:
    """The manifest's JSON Schema, draft 2020-12 (docs/manifest.schema.json is this, written out), for a phone app's
    own reader: field types and ranges, and per layout and routing the rules LAYOUT_RULES and LAYOUTS_OF_ROUTING
    state. The other cross-field rules (shapes that must agree, names that must resolve, top_k <= num_experts) compare
    values, which JSON Schema cannot; docs/formats.md lists them with the function that checks each."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **Manifest.model_json_schema()}
    schema["$id"] = f"https://mobile-moe/{FORMAT}/v{VERSION}.schema.json"
    schema["allOf"] = [_layout_rule(layout, rule) for layout, rule in LAYOUT_RULES.items()] + [
        _routing_rule(routing, layouts) for routing, layouts in LAYOUTS_OF_ROUTING.items()
    ]
    return schema


# --- the same words and bounds for libmobile_moe ----------------------------------------------------------------------

CPP_HEADER = "libmobile_moe/src/manifest_schema.h"


def _enum_name(word: str) -> str:
    """ "expert-paths" -> ExpertPaths, "block_shared" -> BlockShared."""
    return "".join(part.capitalize() for part in word.replace("-", "_").split("_"))


def _cpp_words(enum: str, words: tuple[str, ...], what: str, plural: str = "") -> list[str]:
    array = f"k{plural or enum + 's'}"
    return [
        f"// {what}; {array}[i] is the manifest's word for {enum}(i).",
        f"enum class {enum} {{ {', '.join(_enum_name(word) for word in words)} }};",
        f"inline constexpr const char* {array}[] = {{{', '.join(json.dumps(word) for word in words)}}};",
        f"inline const char* name({enum} value) {{ return {array}[static_cast<int>(value)]; }}",
        "",
    ]


def cpp_header() -> str:
    """libmobile_moe/src/manifest_schema.h: this module's words (layouts, kinds, roles, backends,
    routings, the resize policy's), the layouts of each routing and the kind of each layout, the manifest's file name,
    format, version and tensor dtype, and its bounds, for libmobile_moe, so that the format has one owner in both
    languages (tests/test_docs.py checks the committed file against this)."""
    kinds = tuple(dict.fromkeys(KIND_OF_LAYOUT.values()))
    fits = [f"{{{', '.join('true' if layout in LAYOUTS_OF_ROUTING[r] else 'false' for layout in LAYOUTS)}}}"
            for r in ROUTINGS]  # fmt: skip
    kind_of = ", ".join(f"Kind::{_enum_name(KIND_OF_LAYOUT[layout])}" for layout in LAYOUTS)
    lines = [
        "// Generated from mobile_moe/export/manifest_schema.py, the one manifest schema, by",
        f"//   python -m mobile_moe.export.manifest_schema --cpp-header > {CPP_HEADER}",
        "// Do not edit: change the schema and regenerate (tests/test_docs.py compares the two).",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
        "namespace mobile_moe::library {",
        "",
        f"inline constexpr const char* kManifestFile = {json.dumps(MANIFEST)};",
        f"inline constexpr const char* kFormat = {json.dumps(FORMAT)};",
        f"constexpr int64_t kVersion = {VERSION};",
        f"inline constexpr const char* kTensorDtype = {json.dumps(TENSOR_DTYPE)};",
        f"constexpr int64_t kMaxManifestBytes = {MAX_MANIFEST_BYTES};",
        f"constexpr int64_t kMaxExperts = {MAX_EXPERTS};",
        f"constexpr int64_t kMaxDim = {MAX_DIM};",
        f"constexpr int64_t kMaxElements = {MAX_ELEMENTS};",
        f"constexpr int64_t kMaxClasses = {MAX_CLASSES};",
        f"constexpr int64_t kMaxCount = {MAX_COUNT};",
        f"constexpr int64_t kMaxGraphs = {MAX_GRAPHS};",
        f"constexpr int64_t kMaxName = {MAX_NAME};",
        f"constexpr int64_t kMaxPath = {MAX_PATH};",
        f"constexpr int64_t kMaxLabel = {MAX_LABEL};",
        f"constexpr int64_t kMaxRank = {MAX_RANK};",
        f"constexpr int64_t kMaxTensors = {MAX_TENSORS};",
        f"constexpr int64_t kMaxBlock = {MAX_BLOCK};",
        f"constexpr int64_t kMaxChannels = {MAX_CHANNELS};",
        "",
        *_cpp_words("Layout", LAYOUTS, "How a bundle's graphs compose (composition.layout)"),
        *_cpp_words("Kind", kinds, "What a runner does with a layout (Manifest.kind)"),
        *_cpp_words("Role", ROLES, "What a graph is (graphs[i].role)"),
        *_cpp_words("Backend", BACKENDS, "The runtime a bundle is for (backend)"),
        *_cpp_words("Routing", ROUTINGS, "How the model routes (routing)"),
        *_cpp_words("ResizePolicy", POLICIES, "How predict resizes an image (input.resize.policy)", "ResizePolicies"),
        *_cpp_words("ResizeOrigin", RESIZE_ORIGINS, "Where that policy came from (input.resize.origin)"),
        *_cpp_words("Interpolation", INTERPOLATIONS, "The resize's filter (input.resize.interpolation)"),
        "// kKindOfLayout[layout]: Manifest.kind.",
        f"inline constexpr Kind kKindOfLayout[] = {{{kind_of}}};",
        "// kLayoutFitsRouting[routing][layout]: whether a model routing that way exports as that layout.",
        f"inline constexpr bool kLayoutFitsRouting[][{len(LAYOUTS)}] = {{{', '.join(fits)}}};",
        "",
        "}  // namespace mobile_moe::library",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m mobile_moe.export.manifest_schema [--cpp-header] > docs/manifest.schema.json
    import sys

    if sys.argv[1:] == ["--cpp-header"]:
        print(cpp_header(), end="")
    else:
        print(json.dumps(json_schema(), indent=2))
