"""Per-token reference MoEs on the dense ViT's backbone: V-MoE, Experts Choice and Soft MoE.

    images -> embedding -> blocks (those at cfg.moe_block_indices: MoE layer instead of the MLP) -> head -> logits

Each MoE layer is a router and E expert MLPs (moe.ExpertMLPs). The routers that pick (token choice: V-MoE, WideNet;
experts choice) return a Route by index: the token in each expert buffer slot and the weight its output returns with,
so the layer gathers the buffers and scatter-adds the outputs back (memory traffic only). GShard's dense form, one-hot
dispatch and combine tensors (B, T, E, cap) multiplied in einsums, costs 2 * T * S * D FLOPs for each of the two and a
(B, T, E, cap) mask; `dense_form` still derives it, for the tests that compare with google-research/vmoe's own
numbers. Soft MoE picks nothing (every slot is a softmax-weighted mean of all tokens) and keeps the dense form
(SoftRoute). Routing groups are images: each image's T tokens compete for buffers of `cap` slots per expert (V-MoE
and Experts Choice may train with groups of several images: MoELayer). Shapes never depend on the data (no .item(),
no data-dependent branching), so the whole model exports as one graph with torch.export.

Legend: B images, T tokens per image, D width, E experts, k choices per token, cap buffer slots per expert and image
(Soft MoE: p slots per expert), S = E * cap slots in all, G expert sets (config.expert_sets: one per MoE block here).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from mobile_moe.models.config import ExpertsChoiceConfig, SoftMoEConfig, TokenMoEConfig, VMoEConfig, WideNetConfig
from mobile_moe.models.costs import buffer_capacity
from mobile_moe.models.moe import ExpertMLPs
from mobile_moe.models.routers import at_least_fp32, decided_in_fp32, top_k
from mobile_moe.models.upcycle import block_entry
from mobile_moe.models.vit import (
    Attention,
    Block,
    ClassifierHead,
    TokenEmbedding,
    dense_block,
    init_weights,
    layer_norm,
)
from mobile_moe.utils.outputs import ModelOutput, MoEStats

# --- helpers -----------------------------------------------------------------------------------------------------


def one_hot(indices: Tensor, num_classes: int, dtype: torch.dtype) -> Tensor:
    """(...,) -> (..., num_classes); an index >= num_classes gives an all-zero row (a choice that found no room).

    A comparison rather than F.one_hot, whose range check reads the data and so breaks torch.export.
    """
    classes = torch.arange(num_classes, device=indices.device)
    return (indices.unsqueeze(-1) == classes).to(dtype)


def l2_normalize(x: Tensor, dim: int, eps: float = 1e-6) -> Tensor:
    """x / (||x|| + eps), Soft MoE's Algorithm 2 (not F.normalize, which clamps the norm instead)."""
    return x * torch.reciprocal(x.square().sum(dim, keepdim=True).sqrt() + eps)


def cv_squared(values: Tensor) -> Tensor:
    """(B, E) -> (B,): squared coefficient of variation over experts, (std / mean)^2 with the population std."""
    return (values.std(-1, correction=0) / values.mean(-1)) ** 2


class TokenChoices(NamedTuple):
    """What token-choice routing decided for one group (an image): the Route's `tokens` and `gates` (B, E, cap), each
    token's chosen experts (B, T, k, the k-th last), `assigned` (B, T, E: 1 where e is among the token's top k, before
    the capacity cut) and each choice's buffer slot (B, T, k; >= cap: dropped)."""

    tokens: Tensor
    gates: Tensor
    experts: Tensor
    assigned: Tensor
    slots: Tensor


class Route(NamedTuple):
    """What a picking router hands its MoE layer: expert e's buffer slot c holds token tokens[b, e, c] and its output
    returns to that token weighted by gates[b, e, c]."""

    tokens: Tensor  # (B, E, cap) int64; T (one past the last token) where the slot is empty
    gates: Tensor  # (B, E, cap); 0 where the slot is empty
    stats: MoEStats  # aux_loss (), expert_tokens (B, 1, E): one layer is one expert set, dropped ()


class SoftRoute(NamedTuple):
    """What Soft MoE's router hands its MoE layer: every slot a weighted mean of every token."""

    dispatch: Tensor  # (B, T, E, p): slot (e, c)'s weight on token t, a softmax over t
    combine: Tensor  # (B, T, E, p): weight of slot (e, c)'s output in token t's output, a softmax over the slots
    stats: MoEStats


def dense_form(tokens: Tensor, gates: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
    """A Route's tokens and gates (B, E, cap) -> GShard's dispatch and combine (B, T, E, cap): 1 where token t fills
    slot c of expert e, and that slot's weight in the token's output (google-research/vmoe's dispatchers' form)."""
    dispatch = one_hot(tokens, num_tokens, gates.dtype).permute(0, 3, 1, 2)  # (B, E, cap, T) -> (B, T, E, cap)
    return dispatch, dispatch * gates.unsqueeze(1)


def merge_stats(per_layer: list[MoEStats], shared_experts: bool = False) -> MoEStats:
    """The model's MoEStats from its MoE layers' (each with G = 1): aux losses summed, dropped shares averaged, and
    expert token counts side by side, one expert set per layer (B, L, E), or summed into the one set that every
    layer shares (shared_experts, WideNet: (B, 1, E))."""
    counts = torch.cat([s.expert_tokens for s in per_layer], dim=1)  # (B, L, E)
    return MoEStats(
        aux_loss=torch.stack([s.aux_loss for s in per_layer]).sum(),
        expert_tokens=counts.sum(1, keepdim=True) if shared_experts else counts,
        dropped=torch.stack([s.dropped for s in per_layer]).mean(),
    )


# --- routers -----------------------------------------------------------------------------------------------------


class TokenChoiceRouter(nn.Module):
    """Each token picks its top-k experts; each expert's buffer takes `cap` tokens of an image (V-MoE's
    NoisyTopExpertsPerItemRouter; WideNet's router with noise_std 0, no BPR and the Switch loss).

        logits = W x  (no bias, as vmoe's dense layer; WideNet's keeps one. No LayerNorm: the block's norm2 already
                       normalised x)  (+ N(0, noise_std^2) while training)
        gates = softmax(logits); each token's top-k gates, not renormalised (as in V-MoE)

    Buffer slots go in priority order, all first choices before any second choice: by the top gate, highest first
    (Batch Prioritized Routing, batch_prioritized) or in token order. A choice past `cap` is dropped: the token gets
    nothing from that expert and its residual carries it on.

    Auxiliary loss, per image, then averaged over images:
      "importance-load" (V-MoE, appendix A): (importance + load) / 2. importance = CV^2 over experts of the summed
        clean softmax gates; load = CV^2 of the summed probability that expert e stays in a token's top k when
        only e's noise is drawn again: P(logit_e + noise >= k-th largest noisy logit) = 1 - Phi((threshold -
        logit_e) / noise_std). Without noise (evaluation, or noise_std 0) that probability tends to the 0/1 top-k
        indicator, so load is then the CV^2 of the hard top-k counts: the same number in the limit, without a
        gradient. (google-research/vmoe drops the load term there; keeping its limit makes the reported loss mean
        the same in training and evaluation, and only the importance term has a gradient either way.)
      "switch" (Switch / WideNet Eq. 3-5): E * sum_e m_e P_e with m_e the share of tokens having e among their top k
        (before the capacity cut; the m_e sum to k) and P_e the mean noisy gate of e; k when both are uniform.
    The loss is returned already multiplied by aux_loss_weight.

    The training noise is torch.randn_like on the logits' device: one seed draws other noise on a CPU than on CUDA,
    and inductor's compiled graph (its own Philox stream) other noise than eager, so a run with noise_std > 0 repeats
    exactly only on the same device and mode. Its logits are computed in float32 under autocast (decided_in_fp32).
    """

    def __init__(
        self,
        width: int,
        num_experts: int,
        top_k: int,
        capacity_ratio: float,
        eval_capacity_ratio: float,
        noise_std: float = 0.0,
        batch_prioritized: bool = False,
        balance_loss: str = "importance-load",
        aux_loss_weight: float = 0.0,
        bias: bool = True,
    ):
        super().__init__()
        if balance_loss not in ("importance-load", "switch"):
            raise ValueError(f"balance_loss {balance_loss!r}: expected 'importance-load' or 'switch'")
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_ratio, self.eval_capacity_ratio = capacity_ratio, eval_capacity_ratio
        self.noise_std, self.batch_prioritized = noise_std, batch_prioritized
        self.balance_loss, self.aux_loss_weight = balance_loss, aux_loss_weight
        self.proj = nn.Linear(width, num_experts, bias=bias)

    def capacity(self, tokens: int) -> int:
        ratio = self.capacity_ratio if self.training else self.eval_capacity_ratio
        return buffer_capacity(ratio, self.top_k, tokens, self.num_experts)

    def forward(self, x: Tensor) -> Route:
        """x (B, T, D) -> Route with tokens, gates of shape (B, E, cap)."""
        with decided_in_fp32(x):
            logits = self.proj(at_least_fp32(x))  # (B, T, E)
        noisy = self.training and self.noise_std > 0
        noisy_logits = logits + self.noise_std * torch.randn_like(logits) if noisy else logits
        capacity = self.capacity(x.shape[1])
        gates = noisy_logits.softmax(-1)  # (B, T, E): the noisy gates, routed on and (Switch loss) balanced
        chosen = self.dispatch_by_gates(gates, capacity)
        stats = MoEStats(
            aux_loss=self.aux_loss_weight * self.balance(logits, noisy_logits, gates, chosen),
            expert_tokens=(chosen.tokens < x.shape[1]).to(gates.dtype).sum(-1).unsqueeze(1),  # (B, 1, E)
            dropped=1.0 - (chosen.slots < capacity).to(x.dtype).mean(),
        )
        return Route(chosen.tokens, chosen.gates, stats)

    def dispatch_by_gates(self, probs: Tensor, capacity: int) -> TokenChoices:
        """probs (B, T, E) -> TokenChoices. vmoe's get_top_experts_per_item_dispatcher for one group per image."""
        gates, experts = top_k(probs, self.top_k)  # (B, T, k) each
        slots = self.buffer_slots(experts, gates[..., 0])  # (B, T, k)
        B, T, k = experts.shape
        places = self.num_experts * capacity  # the buffers' slots side by side, expert by expert
        # Each kept (token, choice) writes its token and gate to its slot; a dropped one to one extra place, cut off
        # after (its writes collide there, so what it holds is undefined: it is never read).
        # Tensors, not scalars: Core ML has no where.ScalarOther, and ExecuTorch's int8 quantizer turns a scalar
        # operand of add or mul into a float tensor whatever the other one is (_convert_scalars_to_attrs,
        # executorch/backends/xnnpack/quantizer/xnnpack_quantizer_utils.py:1147), which would make the index float.
        dump, capacities = torch.full_like(slots, places), torch.full_like(experts, capacity)
        place = torch.where(slots < capacity, experts * capacities + slots, dump).reshape(B, T * k)
        token = torch.arange(T, device=probs.device).unsqueeze(1).expand(T, k).reshape(1, T * k).expand(B, T * k)
        tokens = torch.full((B, places + 1), T, dtype=torch.int64, device=probs.device).scatter(1, place, token)
        slot_gates = probs.new_zeros(B, places + 1).scatter(1, place, gates.reshape(B, T * k))
        assigned = one_hot(experts, self.num_experts, probs.dtype).sum(2)  # (B, T, E)
        unflatten = (B, self.num_experts, capacity)
        return TokenChoices(tokens[:, :places].view(unflatten), slot_gates[:, :places].view(unflatten), experts,
                            assigned, slots)  # fmt: skip

    def buffer_slots(self, experts: Tensor, top_gate: Tensor) -> Tensor:
        """(B, T, k) experts, (B, T) top gate -> (B, T, k): the slot each (token, choice) takes in its expert's buffer
        (V-MoE's Algorithm 1; counted past the capacity, so a slot >= cap means dropped)."""
        B, T, k = experts.shape
        if self.batch_prioritized:
            order = top_k(top_gate, T)[1]  # (B, T): tokens by top gate, highest first; ties: lower index first
        else:
            order = torch.arange(T, device=experts.device).expand(B, T)  # (B, T)
        order = order.unsqueeze(-1).expand(B, T, k)  # (B, T, k)
        queue = experts.gather(1, order).transpose(1, 2).reshape(B, k * T)  # (B, k*T): all 1st choices, then 2nd...
        mask = one_hot(queue, self.num_experts, torch.int64)  # (B, k*T, E)
        slots = (mask.cumsum(1) * mask).sum(-1) - 1  # (B, k*T): place in the expert's queue
        slots = slots.reshape(B, k, T).transpose(1, 2)  # (B, T, k) in priority order
        return torch.zeros_like(slots).scatter(1, order, slots)  # (B, T, k) back in token order

    def balance(self, logits: Tensor, noisy_logits: Tensor, gates: Tensor, chosen: TokenChoices) -> Tensor:
        """The unweighted auxiliary loss (see the class docstring), averaged over images; gates: noisy_logits'
        softmax, as routed on."""
        if self.balance_loss == "switch":
            return switch_loss(gates, chosen.assigned).mean()
        noisy = self.training and self.noise_std > 0
        importance = importance_loss(logits.softmax(-1) if noisy else gates)  # (B,): clean gates
        if noisy:
            load = load_loss(logits, noisy_logits, chosen.experts, self.noise_std)
        else:
            load = cv_squared(chosen.assigned.sum(1))  # (B,): the noise-free limit, hard top-k counts
        return ((importance + load) / 2).mean()


def importance_loss(probs: Tensor) -> Tensor:
    """(B, T, E) clean softmax gates -> (B,): CV^2 over experts of their summed gates (V-MoE's importance loss)."""
    return cv_squared(probs.sum(1))


def load_loss(logits: Tensor, noisy_logits: Tensor, experts: Tensor, noise_std: float) -> Tensor:
    """(B,): CV^2 over experts of the summed probability that each stays among a token's top k when only its own
    noise is drawn again: P(logit_e + noise >= the k-th largest noisy logit) (V-MoE's load loss). experts (B, T, k):
    the noisy top k, the last the k-th."""
    threshold = noisy_logits.gather(-1, experts[..., -1:])  # (B, T, 1): the k-th largest noisy logit
    p_chosen = 0.5 * torch.erfc((threshold - logits) / (noise_std * math.sqrt(2.0)))  # (B, T, E)
    return cv_squared(p_chosen.sum(1))


def switch_loss(probs: Tensor, assigned: Tensor) -> Tensor:
    """(B,): E * sum_e m_e P_e (Switch / WideNet Eq. 3-5; vmoe's GShard loss for k = 1): m_e the share of tokens
    having e among their top k (assigned (B, T, E) 0/1), P_e the mean gate of e (probs (B, T, E))."""
    share = assigned.sum(1) / assigned.shape[1]  # (B, E): summing to k over the experts
    return probs.shape[-1] * (share * probs.mean(1)).sum(-1)


class ExpertsChoiceRouter(nn.Module):
    """Each expert takes its top-cap tokens of an image (Zhou et al. 2022; vmoe's items-per-expert router).

        scores = softmax over experts of W x  (B, T, E); expert e takes the cap tokens with the highest score_e,
        cap = min(T, ceil(C * T / E)); combine weight = that score.

    Every buffer is full, so nothing is dropped for lack of room; `dropped` reports instead the share of tokens no
    expert took (they pass through on the residual). No auxiliary loss: the balance is built in.
    """

    def __init__(self, width: int, num_experts: int, capacity_ratio: float, eval_capacity_ratio: float, bias: bool):
        super().__init__()
        self.num_experts = num_experts
        self.capacity_ratio, self.eval_capacity_ratio = capacity_ratio, eval_capacity_ratio
        self.proj = nn.Linear(width, num_experts, bias=bias)

    def capacity(self, tokens: int) -> int:
        ratio = self.capacity_ratio if self.training else self.eval_capacity_ratio
        return buffer_capacity(ratio, 1, tokens, self.num_experts)

    def forward(self, x: Tensor) -> Route:
        """x (B, T, D) -> Route with tokens, gates of shape (B, E, cap)."""
        with decided_in_fp32(x):
            scores = self.proj(at_least_fp32(x)).softmax(-1)  # (B, T, E)
        tokens, gates = self.dispatch_by_scores(scores, self.capacity(x.shape[1]))
        B, E, capacity = tokens.shape
        taken = scores.new_zeros(B, x.shape[1]).scatter(1, tokens.reshape(B, E * capacity), 1.0)  # (B, T) 0/1
        stats = MoEStats(
            aux_loss=x.new_zeros(()),
            expert_tokens=scores.new_full((B, 1, E), float(capacity)),  # every buffer full
            dropped=1.0 - taken.to(x.dtype).mean(),
        )
        return Route(tokens, gates, stats)

    @staticmethod
    def dispatch_by_scores(scores: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
        """scores (B, T, E) -> tokens, gates (B, E, cap): each expert's top-cap tokens, highest first, and their scores
        (vmoe's get_top_items_per_expert_dispatcher, one group per image)."""
        gates, tokens = top_k(scores.transpose(1, 2), capacity)  # (B, E, cap) each
        return tokens, gates


class SoftRouter(nn.Module):
    """Soft MoE (Puigcerver et al. 2023): every slot is a weighted average of all tokens; nothing is picked.

        logits = l2norm_D(X) . (scale * l2norm_D(Phi))   (B, T, E, p)   Phi: (D, E, p) slot parameters, scale init 1
        dispatch = softmax over the T tokens (each slot's column sums to 1)
        combine = softmax over the E * p slots (each token's row sums to 1)

    The l2 normalisation (the paper's Sec. 2.3) keeps the softmax from going one-hot as D grows. Every expert
    processes its p slots: expert_tokens is p per expert and layer, dropped 0, no auxiliary loss.
    """

    def __init__(self, width: int, num_experts: int, slots_per_expert: int):
        super().__init__()
        self.num_experts, self.slots_per_expert = num_experts, slots_per_expert
        # LeCun normal, as vmoe's SoftRouter; only Phi's direction matters after the normalisation.
        self.phi = nn.Parameter(torch.randn(width, num_experts, slots_per_expert) / math.sqrt(width))
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> SoftRoute:
        """x (B, T, D) -> SoftRoute with dispatch, combine of shape (B, T, E, p)."""
        phi = self.scale * l2_normalize(self.phi, 0)  # (D, E, p)
        logits = torch.einsum("btd,dep->btep", l2_normalize(x, -1), phi)  # (B, T, E, p)
        dispatch = logits.softmax(dim=1)  # (B, T, E, p), over tokens
        combine = logits.flatten(2).softmax(-1).reshape(logits.shape)  # (B, T, E*p) -> (B, T, E, p), over slots
        stats = MoEStats(
            aux_loss=x.new_zeros(()),
            expert_tokens=x.new_full((x.shape[0], 1, self.num_experts), float(self.slots_per_expert)),  # (B, 1, E)
            dropped=x.new_zeros(()),
        )
        return SoftRoute(dispatch, combine, stats)


# --- the MoE layer and block -------------------------------------------------------------------------------------


class MoELayer(nn.Module):
    """router -> dispatch -> the experts on their (B, cap, D) buffers, as one batched matmul per MLP layer -> combine;
    x (B, T, D) -> (B, T, D), stats.

    A Route (picking routers), by index:
        buffers[e, b, c] = x[b, tokens[b, e, c]]                         a gather; an empty slot reads a zero row
        y[b, t] = sum over the slots (e, c) holding t of gates[b, e, c] expert_e(buffers)[e, b, c]   a scatter-add
    A SoftRoute (Soft MoE), dense:
        buffers[e, b, c] = sum_t dispatch[b, t, e, c] x[b, t]          "btec,btd->ebcd"
        y[b, t] = sum_{e, c} combine[b, t, e, c] expert_e(buffers)[e, b, c]  "btec,ebcd->btd"

    Empty slots hold zeros; the expert still runs on them (static shapes) but their weight is 0. The gate multiply
    and the combine run in at least float32, under autocast too. The scatter-add sums a token's k outputs (or, for
    experts choice, those of every expert that took it) in one order on a CPU; CUDA's atomics add them in any order,
    which changes the sum's last bits only for three or more (float addition is commutative, not associative).

    While training with `group_images` G > 1, b is a routing group rather than an image: the tokens of G consecutive
    images, (B, T, D) -> (B / G, G * T, D), as google-research/vmoe reshapes its batch into groups. In eval mode every
    image is its own group whatever G is, so the exported graph and evaluation route each image alone.
    """

    def __init__(self, router: nn.Module, experts: ExpertMLPs, group_images: int = 1):
        super().__init__()
        self.router = router
        self.experts = experts
        self.group_images = group_images

    def forward(self, x: Tensor) -> tuple[Tensor, MoEStats]:
        group = self.group_images if self.training else 1
        if group == 1:
            return self.route_groups(x)
        images, tokens, width = x.shape
        if images % group:
            raise ValueError(f"a batch of {images} images does not split into routing groups of {group} images")
        y, stats = self.route_groups(x.reshape(images // group, group * tokens, width))
        per_image = stats.expert_tokens.repeat_interleave(group, 0) / group  # (B, 1, E): a group's counts, shared
        return y.reshape(images, tokens, width), stats._replace(expert_tokens=per_image)

    def route_groups(self, x: Tensor) -> tuple[Tensor, MoEStats]:
        """x (groups, tokens per group, D): each group's tokens compete for its own expert buffers."""
        route = self.router(x)
        if isinstance(route, SoftRoute):  # fixed by the router's kind, not by the data
            buffers = torch.einsum("btec,btd->ebcd", route.dispatch, x)  # (E, B, cap, D)
            E, B, capacity, D = buffers.shape
            outputs = self.experts.buffers_forward(buffers.reshape(E, B * capacity, D)).view(E, B, capacity, D)
            return torch.einsum("btec,ebcd->btd", route.combine, outputs), route.stats  # (B, T, D)
        return self.by_index(x, route), route.stats

    def by_index(self, x: Tensor, route: Route) -> Tensor:
        """x (B, T, D), a Route -> y (B, T, D): the buffers gathered, the outputs scatter-added back."""
        (B, T, D), (E, capacity) = x.shape, route.tokens.shape[1:]
        index = route.tokens.reshape(B, E * capacity, 1).expand(B, E * capacity, D)
        padded = torch.cat([x, x.new_zeros(B, 1, D)], dim=1)  # (B, T + 1, D): index T, an empty slot, reads zeros
        buffers = padded.gather(1, index).view(B, E, capacity, D).transpose(0, 1).reshape(E, B * capacity, D)
        outputs = self.experts.buffers_forward(buffers).view(E, B, capacity, D).transpose(0, 1)  # (B, E, cap, D)
        with decided_in_fp32(x):
            outputs = at_least_fp32(outputs)
            weighted = (outputs * route.gates.unsqueeze(-1).to(outputs.dtype)).reshape(B, E * capacity, D)
            return weighted.new_zeros(B, T + 1, D).scatter_add(1, index, weighted)[:, :T]


class TokenMoEBlock(Block):
    """Pre-norm block whose MLP is an MoELayer: x + attn(LN(x)), then x + MoE(LN(x)); returns (x, stats)."""

    mlp: MoELayer

    def forward(self, x: Tensor) -> tuple[Tensor, MoEStats]:  # type: ignore[override]
        x = self.attend(x)
        y, stats = self.mlp(self.norm2(x))
        return x + y, stats


def token_choice_router(
    cfg: VMoEConfig | WideNetConfig, balance_loss: str, batch_prioritized: bool
) -> TokenChoiceRouter:
    """V-MoE's router (importance-load, BPR) or WideNet's (switch, token order), from the config's own fields."""
    return TokenChoiceRouter(
        cfg.width,
        cfg.num_experts,
        cfg.top_k,
        cfg.capacity_ratio,
        cfg.eval_capacity_ratio,
        noise_std=cfg.router_noise_std,
        batch_prioritized=batch_prioritized,
        balance_loss=balance_loss,
        aux_loss_weight=cfg.aux_loss_weight,
        bias=cfg.router_bias,  # V-MoE's has none, WideNet's keeps one
    )


def make_router(cfg: TokenMoEConfig) -> nn.Module:
    """The router a config's routing kind asks for."""
    if isinstance(cfg, VMoEConfig):
        return token_choice_router(cfg, "importance-load", cfg.batch_prioritized)
    if isinstance(cfg, ExpertsChoiceConfig):
        return ExpertsChoiceRouter(cfg.width, cfg.num_experts, cfg.capacity_ratio, cfg.eval_capacity_ratio,
                                   bias=cfg.router_bias)  # fmt: skip
    if isinstance(cfg, SoftMoEConfig):
        return SoftRouter(cfg.width, cfg.num_experts, cfg.slots_per_expert)
    raise TypeError(f"no per-token router for {type(cfg).__name__}")


def token_moe_block(cfg: TokenMoEConfig) -> TokenMoEBlock:
    return TokenMoEBlock(
        layer_norm(cfg),
        Attention(cfg.width, cfg.num_heads),
        layer_norm(cfg),
        MoELayer(make_router(cfg), ExpertMLPs(cfg.num_experts, cfg.width, cfg.mlp_hidden),
                 getattr(cfg, "routing_group_images", 1)),  # Soft MoE: always one image per group
    )  # fmt: skip


# --- the model ---------------------------------------------------------------------------------------------------


class TokenMoEViT(nn.Module):
    """The dense ViT with MoE layers at cfg.moe_block_indices; the same state-dict layout for embedding, dense blocks
    and head (blocks.i.mlp.experts holds MoE block i's experts as one stack, each upcycled from blocks.i.mlp)."""

    def __init__(self, cfg: TokenMoEConfig):
        super().__init__()
        self.config = cfg
        self.embedding = TokenEmbedding(cfg)
        moe = set(cfg.moe_block_indices)
        self.blocks = nn.ModuleList(token_moe_block(cfg) if i in moe else dense_block(cfg) for i in range(cfg.depth))
        self.head = ClassifierHead(cfg)
        self.apply(init_weights)

    def forward_features(self, images: Tensor) -> tuple[Tensor, MoEStats]:
        """(B, C, H, W) -> (tokens (B, T, D) before the final norm, MoEStats with expert_tokens (B, L, E))."""
        x = self.embedding(images)
        stats = []
        for block in self.blocks:
            if isinstance(block, TokenMoEBlock):  # fixed by the config, not by the data
                x, block_stats = block(x)
                stats.append(block_stats)
            else:
                x = block(x)
        return x, merge_stats(stats)

    def forward_head(self, tokens: Tensor) -> Tensor:
        return self.head(tokens)

    def forward(self, images: Tensor) -> ModelOutput:
        tokens, stats = self.forward_features(images)
        return ModelOutput(self.forward_head(tokens), None, stats)

    def dense_key(self, key: str) -> str | None:
        """Upcycling (mobile_moe/models/upcycle.py): the dense vit entry `key` starts from; None for a fresh router."""
        part, _, rest = key.partition(".")
        if part != "blocks":
            return key  # embedding.*, head.*
        index, _, rest = rest.partition(".")
        return None if rest.startswith("mlp.router.") else block_entry(rest, int(index))
