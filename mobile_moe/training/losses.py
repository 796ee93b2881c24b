"""The training objective (paper, Sec. 2.2):

    L = CE(logits, y) + lambda * CE(router_logits, super(y)) [+ beta * load-balancing loss] [+ the model's own aux]

lambda = 0.3 by default. With lambda = 0 the router learns end to end, only through the gates that scale the expert
outputs; beta > 0 then adds Switch Transformer's balancing loss to keep experts from collapsing. Per-token
routers (V-MoE, WideNet) bring their own auxiliary losses, weighted by their config (`aux_loss_weight`, as in
Hugging Face's `router_aux_loss_coef`): they arrive in ModelOutput.stats and are added as they are. Targets are
probability vectors, so MixUp/CutMix-mixed targets (and their mixed super-classes) go through unchanged.
Legend: B images, C classes, E experts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor

from mobile_moe.utils.outputs import ModelOutput, Routing


class LossTerms(NamedTuple):
    total: Tensor
    classification: Tensor
    router: Tensor  # 0 when there is no router loss
    balance: Tensor  # 0 when there is no balancing loss
    aux: Tensor  # the model's own auxiliary loss, already weighted (0 when it has none)


def load_balancing_loss(routing: Routing) -> Tensor:
    """Switch Transformer's auxiliary loss E * sum_e f_e * P_e, minimal (= 1) when images spread evenly.

    f_e: share of the batch's expert choices that went to e (not differentiable); P_e: mean router probability of e.
    """
    E = routing.probs.shape[-1]
    counts = F.one_hot(routing.experts, E).sum(dim=(0, 1)).float()  # (E,)
    share = counts / counts.sum()  # (E,)
    return E * (share * routing.probs.float().mean(dim=0)).sum()


def training_loss(
    output: ModelOutput,
    targets: Tensor,
    super_targets: Tensor | None,
    router_loss_weight: float,
    balance_loss_weight: float = 0.0,
    label_smoothing: float = 0.0,
) -> LossTerms:
    """targets (B, C) and super_targets (B, E) are probability vectors (one-hot or mixed)."""
    logits = output.logits.float()
    classification = F.cross_entropy(logits, targets, label_smoothing=label_smoothing)
    zero = logits.new_zeros(())
    router = balance = zero
    routing = output.routing
    if routing is not None and super_targets is not None and router_loss_weight > 0:
        router = F.cross_entropy(routing.logits.float(), super_targets)
    if routing is not None and balance_loss_weight > 0:
        balance = load_balancing_loss(routing)
    aux = output.stats.aux_loss.float() if output.stats is not None else zero
    total = classification + router_loss_weight * router + balance_loss_weight * balance + aux
    return LossTerms(total, classification.detach(), router.detach(), balance.detach(), aux.detach())


def hard_labels(targets: Tensor) -> Tensor:
    """(B, C) probability targets -> (B,) the dominant class (the label itself when unmixed)."""
    return targets.argmax(dim=-1)
