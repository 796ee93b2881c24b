"""How images are routed while training: by the router's own choice (default) or by the true super-class.

`--route-by label` sends every training image to the expert of its true super-class, so each expert only ever sees
its own super-class while the router learns from the router loss alone. With k > 1 the true super-class is the first
choice and the router's own highest-scoring other experts fill the remaining k - 1 slots. Gates stay the router's
probabilities of the chosen experts (renormalised if the model does so), so a trained model behaves the same at
inference, where the router picks, as when the router is right in training.
Legend: B images, E experts, k experts per image.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mobile_moe.errors import UsageError
from mobile_moe.outputs import ModelOutput, Routing


def label_routing(routing: Routing, super_labels: Tensor, top_k: int, renormalize: bool = False) -> Routing:
    """The router's decision replaced by the true super-class (first) and the router's next top_k - 1 choices."""
    first = super_labels.view(-1, 1)  # (B, 1)
    if top_k > 1:
        others = routing.probs.detach().scatter(-1, first, float("-inf"))  # (B, E): the true one excluded
        experts = torch.cat([first, others.topk(top_k - 1, dim=-1).indices], dim=-1)  # (B, k)
    else:
        experts = first
    gates = routing.probs.gather(-1, experts)  # (B, k)
    if renormalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return Routing(routing.logits, routing.probs, experts, gates)


class TrainingForward(nn.Module):
    """model(images) during training, with optional label routing; the module DDP wraps (so gradient sync sees it).

    forward(images, super_labels) -> ModelOutput. Label routing uses the Mobile V-MoE's parts (router_stage,
    moe_blocks, forward_head), so it runs exactly the layers the model itself runs.
    """

    def __init__(self, model: nn.Module, route_by: str = "router"):
        super().__init__()
        if route_by == "label" and not hasattr(model, "router_stage"):
            raise UsageError(f"--route-by label needs a Mobile V-MoE; {model.config.name} has no per-image router")
        self.model = model
        self.route_by = route_by

    def forward(self, images: Tensor, super_labels: Tensor | None = None) -> ModelOutput:
        if self.route_by == "router":
            return self.model(images)
        cfg = self.model.config
        x, routing = self.model.router_stage(images)
        routing = label_routing(routing, super_labels, cfg.top_k, cfg.renormalize_gates)
        for block in self.model.moe_blocks:
            x = block(x, routing)
        return ModelOutput(self.model.forward_head(x), routing)
