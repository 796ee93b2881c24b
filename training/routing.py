"""How images are routed while training: by the router's own choice (default) or by the true super-class.

`--route-by label` sends every training image to the expert of its true super-class, so each expert only ever sees
its own super-class while the router learns from the router loss alone. The model does it (its `route_to` option,
see mobile_moe.routers.PerImageRouter): this module only decides when to ask for it.
"""

from __future__ import annotations

from torch import Tensor, nn

from mobile_moe.errors import UsageError
from mobile_moe.outputs import ModelOutput


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
