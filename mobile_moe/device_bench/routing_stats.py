"""What a real routing sequence means for a phone: how often the expert changes, and how often a cache would hit.

Pure functions over the experts chosen per image, in the order the images arrived (k experts per image).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def expert_change_rate(sequence: Sequence[Sequence[int]]) -> float | None:
    """Share of consecutive image pairs whose chosen expert sets differ; None with fewer than two images."""
    if len(sequence) < 2:
        return None
    changes = sum(set(a) != set(b) for a, b in zip(sequence, sequence[1:], strict=False))
    return changes / (len(sequence) - 1)


def lru_hit_rate(sequence: Sequence[Sequence[int]], capacity: int) -> float:
    """Hit rate of an LRU cache of `capacity` expert graphs over the sequence, cold at the start like the runners."""
    if capacity < 1:
        raise ValueError("capacity must be at least 1")
    cache: OrderedDict[int, None] = OrderedDict()
    hits = accesses = 0
    for experts in sequence:
        for expert in experts:
            accesses += 1
            if expert in cache:
                hits += 1
                cache.move_to_end(expert)
            else:
                cache[expert] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / accesses if accesses else 0.0


def cache_hit_rates(sequence: Sequence[Sequence[int]], num_experts: int) -> dict[str, float]:
    """{"1": rate, ..., "E": rate}: keys are strings so the mapping survives JSON unchanged."""
    return {str(size): lru_hit_rate(sequence, size) for size in range(1, num_experts + 1)}


def expert_histogram(sequence: Sequence[Sequence[int]], num_experts: int) -> list[int]:
    counts = [0] * num_experts
    for experts in sequence:
        for expert in experts:
            counts[expert] += 1
    return counts
