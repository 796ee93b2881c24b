"""Which experts an exported bundle's image takes, from what its graphs report: the rules of the bundle runtimes.

The Python runtime (mobile_moe/export/runtime.py) calls these; libmobile_moe's src/bundle_routing.cpp is their
translation into C++, held equal to them case by case, ties and float32 margins included, by
tests/device_bench/test_bundle_routing.py. Change a rule here first, then there. The order of experts is the model's
own: mobile_moe.models.routers.top_k, so eager PyTorch and both runtimes agree even on ties.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

from mobile_moe.models.routers import top_k


def pick_experts(
    probs: np.ndarray, *, k: int, renormalize: bool, resident: Collection[int] = (), margin: float = 0.0
) -> tuple[list[int], list[float]]:
    """(experts, gates) for one image from its router's probabilities `probs` (E,): the k most probable experts
    (top_k's order: ties go to the lower index), except that with a cache `margin` a chosen expert not `resident` is
    replaced by the most probable resident expert not chosen whose probability is within the margin of its own
    (cache-conditional routing, arXiv 2412.00099): a switch avoided for a gate given up. margin 0 is plain top-k.
    Gates are the chosen probabilities, renormalised when the model renormalises; all in float32. Non-finite
    probabilities, which only a corrupt graph gives, are a ValueError."""
    probs = np.asarray(probs, dtype=np.float32).reshape(-1)
    margin = np.float32(margin)  # as the runner reads --cache-margin: a margin below float32's range is 0
    if not 1 <= k <= probs.size:
        raise ValueError(f"top_k {k} with {probs.size} experts")
    if not np.isfinite(probs).all():
        raise ValueError("the router produced a non-finite probability (a corrupt graph?)")
    order = top_k(torch.tensor(probs), probs.size)[1].tolist()
    chosen = order[:k]
    for slot, expert in enumerate(chosen if margin > 0 else []):
        if expert in resident:
            continue
        floor = probs[expert] - margin
        swap = next((e for e in order if e in resident and e not in chosen and probs[e] >= floor), None)
        if swap is not None:
            chosen[slot] = swap
    gates = [probs[e] for e in chosen]
    total = np.float32(0)
    for gate in gates:  # in order, in float32, as the native runner sums
        total += gate
    if renormalize and total > 0:
        gates = [gate / total for gate in gates]
    return chosen, [float(gate) for gate in gates]


def used_experts(expert_tokens: np.ndarray) -> tuple[list[int], list[float]]:
    """(experts, gates) for one image of a whole bundle (a per-token MoE), from the token slots each expert of each
    expert set filled (`expert_tokens`, (1, G, E)): the experts it used in any set (slots summed over the sets > 0),
    ascending, and each one's share of the image's slots. A negative or non-finite count, which only a corrupt graph
    gives, is a ValueError."""
    slots = np.asarray(expert_tokens, dtype=np.float32)
    if not np.isfinite(slots).all() or (slots < 0).any():
        raise ValueError("the whole graph reported a negative or non-finite expert token count (a corrupt graph?)")
    counts = slots.reshape(-1, slots.shape[-1]).astype(np.float64).sum(0)  # (E,)
    experts = [int(e) for e in np.flatnonzero(counts > 0)]
    total = counts.sum()
    return experts, [float(np.float32(counts[e] / total)) for e in experts]
