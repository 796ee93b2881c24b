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


class MoEStats(NamedTuple):
    """What a per-token, experts-choice or soft MoE reports from one forward pass, over all its MoE blocks.

    Per-image models report their one decision as `Routing` instead; these are the numbers that have no single
    decision to read them from. Legend: B images, E experts, G expert sets (config.expert_sets: one per MoE block
    that owns its experts; WideNet's blocks share one), so (expert_tokens > 0).sum((1, 2)) counts the expert MLPs
    whose weights image b needed.
    """

    aux_loss: Tensor  # () the model's own auxiliary loss, already weighted (0 where it has none)
    expert_tokens: Tensor  # (B, G, E) token slots expert e of expert set g filled for image b (0: never used)
    dropped: Tensor  # () share of (token, choice) assignments no buffer had room for, mean over MoE blocks


class ModelOutput(NamedTuple):
    """Every model's forward: logits, the routing decision of a per-image MoE, and the statistics of the others."""

    logits: Tensor  # (B, K)
    routing: Routing | None = None  # per-image routing (Mobile V-MoE, Hard MoE); None otherwise
    stats: MoEStats | None = None  # per-token / experts-choice / soft routing; None otherwise
