"""What models and routers return: named tuples of tensors, so training, metrics and export read intermediates
directly instead of through hooks. Legend: B images, E experts, k experts chosen per image, K classes."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class Routing(NamedTuple):
    """One routing decision."""

    logits: Tensor  # (B, E) router logits: the router loss is a cross-entropy on them
    probs: Tensor  # (B, E) softmax(logits)
    experts: Tensor  # (B, k) int64, chosen experts, highest weight first
    gates: Tensor  # (B, k) their weights g_i


class ModelOutput(NamedTuple):
    """Every model's forward: logits, plus the routing decision for MoE models (None for dense ones)."""

    logits: Tensor  # (B, K)
    routing: Routing | None = None
