"""Routers: small modules that decide which experts see which input.

The contract every router keeps (wave 2 adds per-token, experts-choice, soft and k-means routers on it):

    router(tokens: (B, T, D)) -> Routing(logits, probs, experts, gates)

`experts` and `gates` have shape (*items, k): one row per routed item. A per-image router routes B items (whole
images); a per-token router would route B*T items. The MoE layer (moe.py) dispatches items to experts by these two
tensors alone and never looks inside the router. Routers expose `num_experts` and `top_k`.
"""

from __future__ import annotations

from torch import Tensor, nn

from mobile_moe.outputs import Routing
from mobile_moe.vit import pool_tokens


class PerImageRouter(nn.Module):
    """Mobile V-MoE's router: one decision per image, g = TOP_k(softmax(W LN(x_img))).

    x_img is the class token (cls pooling) or the mean token (mean pooling) after the dense blocks. The top-k weights
    are not renormalised unless asked (the paper does not), so with k=1 the gate is the winning probability.
    """

    def __init__(self, width: int, num_experts: int, top_k: int, pool: str, renormalize_gates: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.pool = pool
        self.renormalize_gates = renormalize_gates
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, num_experts)

    def forward(self, tokens: Tensor) -> Routing:
        """tokens (B, T, D) -> Routing with experts, gates of shape (B, k)."""
        image = pool_tokens(tokens, self.pool)  # (B, D)
        logits = self.proj(self.norm(image))  # (B, E)
        probs = logits.softmax(dim=-1)  # (B, E)
        gates, experts = probs.topk(self.top_k, dim=-1)  # (B, k) each
        if self.renormalize_gates:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return Routing(logits, probs, experts, gates)
