"""The split: which graphs a bundle holds, as small modules that share the model's weights.

What a model can be split into follows from how it routes (its config's `routing`, mobile_moe/models/config.py):
  none              a dense ViT: one "dense" graph.
  image, cluster    one decision per image (Mobile V-MoE's router, Hard MoE's nearest centroid): a router graph and
                    one graph per expert, so a phone loads only the experts an image picks. Hard MoE's experts are
                    whole blocks (no attention shared across experts), so it has expert-paths and no per-block split.
  token, expert,    every token (or every expert) picks for itself inside each MoE block: any image may need any
  soft              expert, so the model exports "whole", every expert in one graph.

Layouts (the manifest's `composition.layout`):
  expert-paths  (k = 1 default)  router: images -> tokens, router_probs; expert_<e>: tokens, gate -> logits, holding
                                 expert e's MLP in every MoE block plus the shared attention, norms and head.
  per-block     (k > 1 default;  router as above; block<i>_shared: tokens -> residual, normed (attention half and
                 k = 1 option)   norm2 of MoE block i); block<i>_expert<e>: normed -> delta (expert e's MLP in block i);
                                 head: tokens -> logits. Per block: tokens = residual + sum_j gate_j * delta_{e_j}.
                                 Shared attention lives once, outside the expert graphs.
  monolithic                     a per-image MoE in one graph, every expert inside (dispatch "dense"): the naive
                                 export. images -> logits, router_probs; the runtime takes the top-k.
  whole                          a per-token MoE in one graph: images -> logits, expert_tokens (1, G, E) (token
                                 slots expert e of expert set g filled: G = config.expert_sets, one per MoE block
                                 owning its experts, 1 for WideNet's shared set; 0: not used by this image). Not the
                                 monolithic layout: that is the naive export of a model that CAN be split and whose
                                 runtime picks experts from router_probs; this is the only export of a model that
                                 cannot, and its runtime reads which experts the image used.
  dense                          a dense ViT: images -> logits.
Families: the experts of expert-paths (one family "expert") and each block's experts in per-block ("block<i>_expert")
share one structure; an ExecuTorch bundle lowers each family once (mobile_moe/export/executorch_family.py).
Legend: S image size, T tokens, D width, E experts, G expert sets, K classes; every graph runs batch 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from mobile_moe.errors import UsageError
from mobile_moe.export.manifest_schema import SPLIT_LAYOUTS, TensorSpec
from mobile_moe.models.config import PER_IMAGE_ROUTINGS, PER_TOKEN_ROUTINGS
from mobile_moe.models.moe import ExpertMLPs, unstacked_view
from mobile_moe.models.vit import Block


def tensor_spec(name: str, *shape: int) -> TensorSpec:
    """A float32 graph input or output as the manifest records it."""
    return TensorSpec(name=name, shape=[int(size) for size in shape], dtype="float32")


@dataclass
class GraphSpec:
    name: str
    role: str  # router | trunk_tail | expert | block_shared | block_expert | head | monolithic | whole | dense
    module: nn.Module
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    expert: int | None = None
    block: int | None = None

    def example_inputs(self) -> tuple[Tensor, ...]:
        generator = torch.Generator().manual_seed(0)
        return tuple(torch.randn(spec.shape, generator=generator) for spec in self.inputs)

    @property
    def params(self) -> int:
        """Weights the graph's file carries: parameters and buffers (Hard MoE's k-means centroids are buffers, and
        cost accounting counts them as parameters too). parameters() and buffers() already skip shared duplicates."""
        return sum(t.numel() for t in self.module.parameters()) + sum(t.numel() for t in self.module.buffers())


@dataclass
class Split:
    layout: str  # expert-paths | per-block | monolithic | whole | dense
    graphs: list[GraphSpec]
    composition: dict[str, Any] = field(default_factory=dict)
    # Graphs of one structure that differ only in some of their weights, by the name of the program they can share
    # (a backend that keeps weights outside its programs lowers each family once:
    # mobile_moe/export/executorch_family.py).
    families: dict[str, list[str]] = field(default_factory=dict)


# --- wrapper modules: each lifts existing parts of the model, copies no weights -------------------------------------


class RouterGraph(nn.Module):
    """images (1, 3, S, S) -> tokens (1, T, D), router_probs (1, E). Top-k is the runtime's job (no data-dependent
    outputs in the graph, and the runtime can read every expert's probability). With early routing (`up_to_router`,
    router_block) the tokens are those after dense block J the router read; the TrunkTailGraph runs the rest, which a
    runner does while it loads the chosen expert."""

    def __init__(self, model: nn.Module, up_to_router: bool = False):
        super().__init__()
        self.router_stage = model.router_stage
        self.up_to_router = up_to_router

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        route = self.router_stage.route if self.up_to_router else self.router_stage
        tokens, routing = route(images)
        return tokens, routing.probs


class TrunkTailGraph(nn.Module):
    """tokens after dense block J (1, T, D) -> tokens after the last dense block (1, T, D)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.router_stage = model.router_stage

    def forward(self, tokens: Tensor) -> Tensor:
        return self.router_stage.tail(tokens)


class BlockShared(nn.Module):
    """tokens (1, T, D) -> residual (1, T, D) after attention, normed = norm2(residual): the expert-independent half."""

    def __init__(self, block: nn.Module):
        super().__init__()
        # The block without its experts, so that `params` counts what this graph holds (the norms and attention).
        self.block = Block(block.norm1, block.attn, block.norm2, nn.Identity())

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        residual = self.block.attend(tokens)
        return residual, self.block.norm2(residual)


class MonolithicGraph(nn.Module):
    """images -> logits, router_probs with every expert in one graph (each runs, weighted by the sparse gates)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = unstacked_view(model)  # each expert's linears over weights of their own: XNNPACK delegates them

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        output = self.model(images, dispatch="dense")
        return output.logits, output.routing.probs


class WholeGraph(nn.Module):
    """images -> logits (1, K), expert_tokens (1, G, E) for a per-token MoE: every expert in the graph, static shapes
    (the model's eval-mode capacity follows from the token count alone). expert_tokens is MoEStats' count of the token
    slots expert e of set g filled: how the runtime learns which experts (and expert MLPs) an image used."""

    def __init__(self, model: nn.Module):
        super().__init__()
        # A model whose blocks share modules offers a view with one module object per block (WideNet): the backends
        # partition by module, and ONE module used in every block would not be delegated.
        self.model = model.graph_capture_view() if hasattr(model, "graph_capture_view") else model

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        output = self.model(images)
        return output.logits, output.stats.expert_tokens.to(torch.float32)


class DenseGraph(nn.Module):
    """images -> logits for a dense ViT (ModelOutput is not an export output type)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images).logits


# --- the split -----------------------------------------------------------------------------------------------------


def routing_of(model: nn.Module) -> str:
    """The model's routing kind (its config's `routing`); a module that is not a registry model is refused."""
    routing = getattr(getattr(model, "config", None), "routing", None)
    if routing is None:
        raise UsageError(
            f"{type(model).__name__} is not a mobile-moe model (it has no config.routing): export a model built by "
            "mobile_moe.models.registry (a training run directory)"
        )
    if routing not in ("none", *PER_IMAGE_ROUTINGS, *PER_TOKEN_ROUTINGS):
        raise UsageError(f"model {model.config.name!r} routes by {routing!r}, which export does not know how to split")
    return routing


def _require_parts(model: nn.Module, parts: tuple[str, ...], why: str) -> None:
    """The modules a split lifts out of the model (mobile_moe's shared API); a model lacking one is refused."""
    missing = [part for part in parts if not hasattr(model, part)]
    if missing:
        raise UsageError(f"model {model.config.name!r} has no {', '.join(missing)}: {why}")


def default_layout(model: nn.Module) -> str:
    return "expert-paths" if model.config.top_k == 1 else "per-block"


def split_model(model: nn.Module, *, monolithic: bool = False, layout: str | None = None) -> Split:
    """The graphs to export for `model` (in eval mode); see the module docstring for the layouts."""
    routing = routing_of(model)
    cfg = model.config
    images = tensor_spec("images", 1, cfg.in_chans, cfg.image_size, cfg.image_size)
    logits = tensor_spec("logits", 1, cfg.num_classes)
    if routing == "none":
        if monolithic or layout:
            raise UsageError("--monolithic and --layout apply to per-image MoEs; a dense ViT is always one graph")
        return Split("dense", [GraphSpec("dense", "dense", DenseGraph(model), [images], [logits])], {"layout": "dense"})
    if routing in PER_TOKEN_ROUTINGS:
        return _whole_split(model, images, logits, monolithic, layout)
    probs = tensor_spec("router_probs", 1, cfg.num_experts)
    if monolithic:
        if layout:
            raise UsageError("--layout does not apply with --monolithic (one graph holds every expert)")
        graph = GraphSpec("monolithic", "monolithic", MonolithicGraph(model), [images], [logits, probs])
        return Split("monolithic", [graph], {"layout": "monolithic"})
    layout = layout or default_layout(model)
    _check_layout(model, layout)
    _require_parts(model, ("router_stage", "expert_path"), "the split lifts the router stage and each expert's path")
    tokens = tensor_spec("tokens", 1, cfg.num_tokens, cfg.width)
    if getattr(cfg, "early_routing", False):
        return _early_routing_split(model, layout, images, tokens, probs, logits)
    router = GraphSpec("router", "router", RouterGraph(model), [images], [tokens, probs])
    if layout == "expert-paths":
        return _expert_paths_split(model, router, tokens, logits)
    return _per_block_split(model, router, tokens, logits)


def _early_routing_split(
    model: nn.Module, layout: str, images: TensorSpec, tokens: TensorSpec, probs: TensorSpec, logits: TensorSpec
) -> Split:
    """expert-paths with the trunk cut at the router: router (images -> tokens after block J, router_probs), a
    trunk-tail graph (the dense blocks after J), then the chosen expert, as without early routing."""
    if layout != "expert-paths":
        raise UsageError(
            f"router_block={model.config.router_block} (early routing) exports as --layout expert-paths only; the "
            "per-block layout keeps the router's tokens as the first MoE block's input"
        )
    router = GraphSpec("router", "router", RouterGraph(model, up_to_router=True), [images], [tokens, probs])
    tail = GraphSpec("trunk_tail", "trunk_tail", TrunkTailGraph(model), [tokens], [tokens])
    split = _expert_paths_split(model, router, tokens, logits)
    split.graphs.insert(1, tail)
    split.composition["trunk_tail"] = tail.name
    split.composition["combine"] = (
        "tokens = trunk_tail(router.tokens), run while expert e loads; logits = expert_<e>(tokens, gate)"
    )
    return split


def _whole_split(model: nn.Module, images: TensorSpec, logits: TensorSpec, monolithic: bool, layout: str | None):
    cfg = model.config
    if monolithic or layout:
        flag = "--monolithic" if monolithic else f"--layout {layout}"
        raise UsageError(
            f"{flag} does not apply to {cfg.name} (routing {cfg.routing!r}): its experts serve tokens, not whole "
            "images, so any image may need any expert and the model always exports whole, every expert in one graph; "
            "leave it out"
        )
    expert_tokens = tensor_spec("expert_tokens", 1, cfg.expert_sets, cfg.num_experts)
    graph = GraphSpec("whole", "whole", WholeGraph(model), [images], [logits, expert_tokens])
    composition = {
        "layout": "whole",
        "combine": "logits, expert_tokens = whole(images); the image used expert e of set g if expert_tokens[g, e] > 0",
    }
    return Split("whole", [graph], composition)


def _check_layout(model: nn.Module, layout: str) -> None:
    """`layout` is one a per-image MoE of this kind and k can be split into; a clear reason otherwise."""
    cfg = model.config
    if layout not in SPLIT_LAYOUTS:
        raise UsageError(f"--layout {layout!r}: choose one of {', '.join(SPLIT_LAYOUTS)}")
    if layout == "per-block" and cfg.routing == "cluster":
        raise UsageError(
            f"--layout per-block does not apply to {cfg.name}: its experts are whole blocks (their own attention), so "
            "nothing is shared between experts inside a block; use --layout expert-paths (the default)"
        )
    if layout == "per-block":
        _require_parts(model, ("moe_blocks", "head"), "the per-block layout lifts each MoE block's halves")
        if not all(isinstance(block.mlp, ExpertMLPs) for block in model.moe_blocks):
            raise UsageError("model's MoE blocks hold no per-expert MLPs (ExpertMLPs); it cannot be split per block")
    if layout == "expert-paths" and cfg.top_k != 1:
        raise UsageError(
            f"layout expert-paths needs top_k = 1 (this model picks k = {cfg.top_k} experts per image, whose outputs "
            "mix inside every MoE block); use --layout per-block"
        )


def _expert_paths_split(model: nn.Module, router: GraphSpec, tokens: TensorSpec, logits: TensorSpec) -> Split:
    gate = tensor_spec("gate", 1, 1)
    experts = [
        GraphSpec(f"expert_{e}", "expert", model.expert_path(e), [tokens, gate], [logits], e)
        for e in range(model.config.num_experts)
    ]
    composition = {
        "layout": "expert-paths",
        "router": "router",
        "experts": [graph.name for graph in experts],
        "combine": "logits = expert_<e>(tokens, gate) for the single chosen expert e",
    }
    return Split("expert-paths", [router, *experts], composition, {"expert": composition["experts"]})


def _per_block_split(model: nn.Module, router: GraphSpec, tokens: TensorSpec, logits: TensorSpec) -> Split:
    residual = tensor_spec("residual", *tokens.shape)
    normed = tensor_spec("normed", *tokens.shape)
    delta = tensor_spec("delta", *tokens.shape)
    graphs, blocks = [router], []
    for i, block in enumerate(model.moe_blocks):
        shared = GraphSpec(
            f"block{i}_shared", "block_shared", BlockShared(block), [tokens], [residual, normed], None, i
        )
        experts = [
            GraphSpec(f"block{i}_expert{e}", "block_expert", block.mlp.expert(e), [normed], [delta], e, i)
            for e in range(len(block.mlp))
        ]
        graphs += [shared, *experts]
        blocks.append({"shared": shared.name, "experts": [graph.name for graph in experts]})
    graphs.append(GraphSpec("head", "head", model.head, [tokens], [logits]))
    composition = {
        "layout": "per-block",
        "router": "router",
        "blocks": blocks,
        "head": "head",
        "combine": (
            "x = router.tokens; per block: residual, normed = shared(x); "
            "x = residual + sum over chosen experts j of gate_j * expert_j(normed).delta; logits = head(x)"
        ),
    }
    families = {f"block{i}_expert": block["experts"] for i, block in enumerate(blocks)}
    return Split("per-block", graphs, composition, families)
