"""Routers: small modules that decide which experts see which input, and THE top-k rule every one of them uses.

The contract every router keeps (wave 2 adds per-token, experts-choice, soft and k-means routers on it):

    router(tokens: (B, T, D)) -> Routing(logits, probs, experts, gates)

`experts` and `gates` have shape (*items, k): one row per routed item. A per-image router routes B items (whole
images); a per-token router would route B*T items. The MoE layer (moe.py) dispatches items to experts by these two
tensors alone and never looks inside the router. Routers expose `num_experts` and `top_k`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from mobile_moe.models.vit import pool_tokens
from mobile_moe.utils.outputs import Routing


def top_k(scores: Tensor, k: int, dim: int = -1) -> tuple[Tensor, Tensor]:
    """(values, indices) of the k largest scores along `dim`, largest first; equal scores: the LOWER index first.

    The one top-k rule of the toolkit. torch.topk promises no order among ties, so this is a stable descending sort;
    the bundle runtimes pick experts from the exported router probabilities by it (mobile_moe/export/bundle_routing.py,
    and its C++ translation in the native runner's bundle_routing.h: std::stable_sort by >), so eager PyTorch, the
    Python runtime and the C++ runner agree even when probabilities tie (tests/test_top_k.py).
    """
    values, indices = torch.sort(scores, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


def decided_in_fp32(x: Tensor) -> contextlib.AbstractContextManager:
    """The context a router decides in: autocast off on x's device, so its projection, softmax and top-k run in the
    float32 that the exported router runs in (bf16 training would tie about 0.5% of decisions and flip about 0.3%
    at D=192, E=10); where autocast is off already (CPU training, export, the runtimes) no context at all, so the
    exported graphs are unchanged. Callers pass at_least_fp32(x) inside it."""
    device = x.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


def at_least_fp32(x: Tensor) -> Tensor:
    """x in float32 if it is in a narrower float (bf16 activations under autocast); a float64 model stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def top_k_with_first(probs: Tensor, k: int, first: Tensor) -> Tensor:
    """(B, k) experts: `first` (B,) forced as the first choice, then the k - 1 best of the others (label routing)."""
    first = first.view(-1, 1)  # (B, 1)
    if k == 1:
        return first
    others = probs.detach().scatter(-1, first, float("-inf"))  # (B, E): the forced one excluded
    return torch.cat([first, top_k(others, k - 1)[1]], dim=-1)


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

    def forward(self, tokens: Tensor, route_to: Tensor | None = None) -> Routing:
        """tokens (B, T, D) -> Routing with experts, gates of shape (B, k).

        route_to (B,), optional: label routing for training (`--route-by label`): that expert becomes each image's
        first choice and the router's best others fill the remaining k - 1. Gates stay the router's probabilities of
        the chosen experts, so a model trained this way behaves the same at inference, where the router picks.
        """
        with decided_in_fp32(tokens):
            image = at_least_fp32(pool_tokens(tokens, self.pool))  # (B, D)
            logits = self.proj(self.norm(image))  # (B, E)
            probs = logits.softmax(dim=-1)  # (B, E)
            if route_to is None:
                gates, experts = top_k(probs, self.top_k)  # (B, k) each
            else:
                experts = top_k_with_first(probs, self.top_k, route_to)  # (B, k)
                gates = probs.gather(-1, experts)
            if self.renormalize_gates:
                gates = gates / gates.sum(dim=-1, keepdim=True)
        return Routing(logits, probs, experts, gates)
