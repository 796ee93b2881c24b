"""The split: which graphs a bundle holds, as small modules that share the model's weights.

Layouts (the manifest's `composition.layout`):
  expert-paths  (k = 1 default)  router: images -> tokens, router_probs; expert_<e>: tokens, gate -> logits, holding
                                 expert e's MLP in every MoE block plus the shared attention, norms and head.
  per-block     (k > 1 default;  router as above; block<i>_shared: tokens -> residual, normed (attention half and
                 k = 1 option)   norm2 of MoE block i); block<i>_expert<e>: normed -> delta (expert e's MLP in block i);
                                 head: tokens -> logits. Per block: tokens = residual + sum_j gate_j * delta_{e_j}.
                                 Shared attention lives once, outside the expert graphs.
  monolithic                     the whole Mobile V-MoE, every expert inside (dense_mixture): the naive export.
  dense                          a dense ViT: images -> logits.
Legend: S image size, T tokens, D width, E experts, K classes; every graph runs batch 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from mobile_moe.errors import UsageError
from mobile_moe.moe import ExpertMLPs
from mobile_moe.routers import PerImageRouter

LAYOUTS = ("expert-paths", "per-block")


@dataclass
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass
class GraphSpec:
    name: str
    role: str  # router | expert | block_shared | block_expert | head | monolithic | dense
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
        return sum(p.numel() for p in self.module.parameters())  # parameters() already skips shared duplicates


@dataclass
class Split:
    layout: str  # expert-paths | per-block | monolithic | dense
    graphs: list[GraphSpec]
    composition: dict[str, Any] = field(default_factory=dict)


# --- wrapper modules: each lifts existing parts of the model, copies no weights -------------------------------------


class RouterGraph(nn.Module):
    """images (1, 3, S, S) -> tokens (1, T, D), router_probs (1, E). Top-k is the runtime's job (no data-dependent
    outputs in the graph, and the runtime can read every expert's probability)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.router_stage = model.router_stage

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        tokens, routing = self.router_stage(images)
        return tokens, routing.probs


class BlockShared(nn.Module):
    """tokens (1, T, D) -> residual (1, T, D) after attention, normed = norm2(residual): the expert-independent half."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        residual = self.block.attend(tokens)
        return residual, self.block.norm2(residual)


class MonolithicGraph(nn.Module):
    """images -> logits, router_probs with every expert in one graph (each runs, weighted by the sparse gates)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        output = self.model(images, dispatch="dense")
        return output.logits, output.routing.probs


class DenseGraph(nn.Module):
    """images -> logits for a dense ViT (ModelOutput is not an export output type)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images).logits


# --- the split -----------------------------------------------------------------------------------------------------


def model_kind(model: nn.Module) -> str:
    """ "dense" or "mobile-vmoe"; anything else cannot be split, with the reason in the message."""
    config = getattr(model, "config", None)
    name = getattr(config, "name", None)
    if name == "vit":
        return "dense"
    has_split = all(hasattr(model, attr) for attr in ("router_stage", "expert_path", "moe_blocks", "head"))
    if not has_split or not isinstance(getattr(model, "router", None), PerImageRouter):
        raise UsageError(
            f"model {name or type(model).__name__!r} cannot be split into router and expert graphs: only a per-image "
            "router (Mobile V-MoE) picks the experts once per image; a per-token router needs every expert for every "
            "image. Export a mobile-vmoe or a dense vit model"
        )
    if not all(isinstance(block.mlp, ExpertMLPs) for block in model.moe_blocks):
        raise UsageError("model's MoE blocks do not hold per-expert MLPs (ExpertMLPs); it cannot be split")
    return "mobile-vmoe"


def default_layout(model: nn.Module) -> str:
    return "expert-paths" if model.config.top_k == 1 else "per-block"


def split_model(model: nn.Module, *, monolithic: bool = False, layout: str | None = None) -> Split:
    """The graphs to export for `model` (in eval mode); see the module docstring for the layouts."""
    kind = model_kind(model)
    cfg = model.config
    S, T, D, K = cfg.image_size, cfg.num_tokens, cfg.width, cfg.num_classes
    images = TensorSpec("images", (1, cfg.in_chans, S, S))
    logits = TensorSpec("logits", (1, K))
    if kind == "dense":
        if monolithic or layout:
            raise UsageError("--monolithic and --layout apply to Mobile V-MoE models; a dense ViT is always one graph")
        return Split("dense", [GraphSpec("dense", "dense", DenseGraph(model), [images], [logits])], {"layout": "dense"})
    E = cfg.num_experts
    probs = TensorSpec("router_probs", (1, E))
    if monolithic:
        if layout:
            raise UsageError("--layout does not apply with --monolithic (one graph holds every expert)")
        graph = GraphSpec("monolithic", "monolithic", MonolithicGraph(model), [images], [logits, probs])
        return Split("monolithic", [graph], {"layout": "monolithic"})
    layout = layout or default_layout(model)
    if layout not in LAYOUTS:
        raise UsageError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    if layout == "expert-paths" and cfg.top_k != 1:
        raise UsageError(
            f"layout expert-paths needs top_k = 1 (this model picks k = {cfg.top_k} experts per image, whose outputs "
            "mix inside every MoE block); use --layout per-block"
        )
    tokens = TensorSpec("tokens", (1, T, D))
    router = GraphSpec("router", "router", RouterGraph(model), [images], [tokens, probs])
    if layout == "expert-paths":
        experts = [
            GraphSpec(f"expert_{e}", "expert", model.expert_path(e), [tokens, TensorSpec("gate", (1, 1))], [logits], e)
            for e in range(E)
        ]
        composition = {
            "layout": layout,
            "router": "router",
            "experts": [graph.name for graph in experts],
            "combine": "logits = expert_<e>(tokens, gate) for the single chosen expert e",
        }
        return Split(layout, [router, *experts], composition)
    return _per_block_split(model, router, tokens, logits)


def _per_block_split(model: nn.Module, router: GraphSpec, tokens: TensorSpec, logits: TensorSpec) -> Split:
    residual = TensorSpec("residual", tokens.shape)
    normed = TensorSpec("normed", tokens.shape)
    delta = TensorSpec("delta", tokens.shape)
    graphs, blocks = [router], []
    for i, block in enumerate(model.moe_blocks):
        shared = GraphSpec(
            f"block{i}_shared", "block_shared", BlockShared(block), [tokens], [residual, normed], None, i
        )
        experts = [
            GraphSpec(f"block{i}_expert{e}", "block_expert", mlp, [normed], [delta], e, i)
            for e, mlp in enumerate(block.mlp.experts)
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
    return Split("per-block", graphs, composition)
