"""How images are routed while training: by the router's own choice (default) or by the true super-class.

`--route-by label` sends every training image to the expert of its true super-class, so each expert only ever sees
its own super-class while the router learns from the router loss alone. The model does it (its `route_to` option,
see mobile_moe.models.routers.PerImageRouter): this module only decides when to ask for it.
"""

from __future__ import annotations

from torch import Tensor, nn

from mobile_moe.errors import UsageError
from mobile_moe.utils.outputs import ModelOutput


class TrainingForward(nn.Module):
    """model(images) during training, with optional label routing; the module DDP wraps (so gradient sync sees it)."""

    def __init__(self, model: nn.Module, route_by: str = "router"):
        super().__init__()
        if route_by == "label" and model.config.routing != "image":
            raise UsageError(
                f"--route-by label needs a learned per-image router (mobile-vmoe); {model.config.name} has none"
            )
        self.model = model
        self.route_by = route_by

    def forward(self, images: Tensor, super_labels: Tensor | None = None) -> ModelOutput:
        if self.route_by == "router":
            return self.model(images)
        return self.model(images, route_to=super_labels)


COLLAPSED_SHARE = 0.99  # the top_k busiest experts taking this share of the routing leave the others idle


def collapse_warning(expert_load: list[float] | None, top_k: int, epoch: int) -> str | None:
    """What to say when the router sends (nearly) every validation image to the same top_k experts of more: the other
    experts see no images and learn nothing. `expert_load`: evaluate's share of images using each expert. A per-token
    MoE's images each use most experts, so its loads never concentrate like this."""
    if not expert_load or len(expert_load) <= max(top_k, 1):
        return None
    busiest = sorted(range(len(expert_load)), key=expert_load.__getitem__, reverse=True)[: max(top_k, 1)]
    share = sum(expert_load[e] for e in busiest) / sum(expert_load) if sum(expert_load) else 0.0
    if share < COLLAPSED_SHARE:
        return None
    experts = ", ".join(map(str, sorted(busiest)))
    return (
        f"warning: epoch {epoch}: the router sent {100 * share:.1f}% of validation images to expert(s) {experts} of "
        f"{len(expert_load)} (expert_load in metrics.jsonl); the others learn nothing: check the super-classes "
        "(`mobile-moe superclass show`), or add a --balance-loss"
    )
