"""The inputs each graph really sees on given images, from the eager model: int8 calibration sets.

Expert graphs only see images routed to them; an expert that too few images pick is topped up with images forced to
it (gate = its router probability; a Hard MoE's gate is always 1, its one-hot probability would be 0 and silence
the expert's blocks), so every expert's observers see a representative range. Single-graph layouts
(dense, monolithic, whole) see the images themselves: a whole per-token graph routes inside, every image reaching
the experts its tokens pick, so the observers of each expert see exactly the tokens it is given.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from mobile_moe.export.graphs import Split

Inputs = tuple[Tensor, ...]


def _per_block_inputs(model, tokens: Tensor, experts: list[int], gates: Tensor, record: dict, only_experts: bool):
    """Run the per-block composition for one image, recording the inputs of each graph it runs."""
    x = tokens  # (1, T, D)
    for i, block in enumerate(model.moe_blocks):
        if not only_experts:
            record[f"block{i}_shared"].append((x,))
        residual = block.attend(x)
        normed = block.norm2(residual)
        for expert in experts:
            record[f"block{i}_expert{expert}"].append((normed,))
        x = residual + sum(g * block.mlp.run_expert(e, normed) for e, g in zip(experts, gates.tolist(), strict=True))
    if not only_experts:
        record["head"].append((x,))


def _forced_gate(model, routing, expert: int) -> Tensor:
    """(1,) the gate expert `expert` would get if this image were routed to it."""
    if model.config.routing == "cluster":  # nearest centroid: the chosen expert's gate is 1, whichever it is
        return torch.ones_like(routing.probs[:, expert])
    return routing.probs[:, expert]


@torch.no_grad()
def graph_inputs(split: Split, model, images: Tensor, min_per_expert: int = 4) -> dict[str, list[Inputs]]:
    """{graph name: [input tuple per image]} for images (N, C, S, S)."""
    record: dict[str, list[Inputs]] = defaultdict(list)
    singles = [image[None] for image in images]  # each (1, C, S, S)
    if split.layout in ("dense", "monolithic", "whole"):
        record[split.graphs[0].name] = [(image,) for image in singles]
        return dict(record)
    routed = [model.router_stage(image) for image in singles]  # (tokens, Routing) per image
    record["router"] = [(image,) for image in singles]
    for tokens, routing in routed:
        experts, gates = routing.experts[0].tolist(), routing.gates[0]
        if split.layout == "expert-paths":
            record[f"expert_{experts[0]}"].append((tokens, gates.reshape(1, 1)))
        else:
            _per_block_inputs(model, tokens, experts, gates, record, only_experts=False)
    for expert in range(model.config.num_experts):
        name = f"expert_{expert}" if split.layout == "expert-paths" else f"block0_expert{expert}"
        for tokens, routing in routed:
            if len(record[name]) >= min(min_per_expert, len(routed)):
                break
            if expert in routing.experts[0].tolist():
                continue
            gate = _forced_gate(model, routing, expert)  # (1,)
            if split.layout == "expert-paths":
                record[name].append((tokens, gate.reshape(1, 1)))
            else:
                _per_block_inputs(model, tokens, [expert], gate, record, only_experts=True)
    return dict(record)
