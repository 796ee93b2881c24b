"""What one round (one runner process on one bundle) must report, whichever runner ran it.

Every runner (the native C++ runner on the host or over adb, the Python worker around export's runtime, Core ML)
returns the JSON object it printed (RoundJson). mobile_moe/device_bench/results.py `validate_round` turns it into a
RoundReport before anything reads it, so a runner that leaves a field out is refused by name instead of failing deep
inside the aggregate, and what reads a round reads typed fields.
A runner that cannot measure a value gives null (None) for it; it never leaves the key out. Runners may add keys
of their own (the native runner's files_opened, loads, graph_bytes, ...): they pass through to raw_first_round.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class _Report(BaseModel):
    # strict: "3" is no number and true no integer (an int passes for a float: JSON writes 3.0 as 3); a runner's own
    # extra keys pass through.
    model_config = ConfigDict(strict=True, extra="allow")


class Latency(_Report):
    """Percentiles and mean of timed samples in ms (linear interpolation, numpy's default, on every runner): what a
    round reports and what results.json keeps of the rounds (their medians)."""

    p50: float
    p90: float
    p99: float
    mean: float

    @model_validator(mode="after")
    def _ordered(self) -> Latency:
        if not self.p50 <= self.p90 <= self.p99:
            raise ValueError(f"latency percentiles out of order: {self.model_dump()}")
        return self


class Summary(Latency):
    """A round's timed samples themselves, with their percentiles."""

    min: float
    max: float
    samples: list[float]


class Memory(_Report):
    """The runner process's memory at one moment, as the OS reports it; None where the OS does not say (macOS)."""

    rss_bytes: int | None
    peak_rss_bytes: int | None  # the high-water mark so far (VmHWM)
    pss_bytes: int | None


class ImageRow(_Report):
    """One image of the routing pass (every image once, in order, cache cold at the start)."""

    experts: list[int]  # chosen experts; empty for a dense bundle
    gates: list[float]
    logits: list[float]
    router_ms: float
    expert_ms: float
    load_ms: float  # expert graphs loaded for this image (0 on a cache hit)
    total_ms: float
    cache_hit: bool


class SwitchParts(_Report):
    """Where a switch's milliseconds go (medians; the native runner's loads, graph_loader.h): parsing the program
    (0 once the family's program is parsed), opening the expert's weights file, checking its packed-weight cache
    file, initialising the method (XNNPACK packs, or maps packed, weights), hashing a cache file the load wrote,
    the first run, and what none of these cover."""

    program: float | None
    data_map: float | None
    cache_check: float | None
    method_init: float | None
    cache_record: float | None
    first_run: float | None
    other: float | None


class SwitchSet(_Report):
    """Switches measured one way: an expert not loaded, loaded and run once (ms), then run again (warm). Medians are
    None when nothing was timed (a dense or one-graph bundle, --switch-repeats 0)."""

    ms: list[float]
    median_ms: float | None
    load_median_ms: float | None
    first_run_median_ms: float | None
    warm_expert_run_median_ms: float | None  # the same expert's next run, for comparison
    # "parked" (switched back to a parked expert: nothing loaded), "mapped" (from a warm packed-weight cache) or
    # "packed"; None: not measured
    weights: str | None = None
    parts_median_ms: SwitchParts | None = None  # None where a runner cannot take a load apart


class Switch(SwitchSet):
    """What routing to another expert costs while serving (from the packed-weight cache when there is one), and
    from an empty cache (`cold`; None without a cache)."""

    cache: str | None = None  # "warm" (the graph's own packed-weight cache file), "off"; None: the runner has none
    cold: SwitchSet | None = None
    note: str | None = None  # why nothing was timed


class RoundReport(_Report):
    runner: str
    bundle: str  # as the runner saw it (a device path on a phone)
    threads: int
    load_ms: dict[str, float]  # cold load of what is resident from the start: {"router" or the bundle kind: ms}
    expert_load_ms: dict[str, float]  # cold load of each expert graph, by expert index; {} for one-graph bundles
    images: list[ImageRow]
    graphs_loaded_after_routing: list[str]
    latency_ms: Summary  # warm end to end per image
    stages_ms: dict[str, Summary]  # "router" and "expert" for split bundles, the bundle kind for one graph
    switch: Switch
    memory_at_start: Memory
    memory_after_first_load: Memory
    memory_after_warm: Memory  # after the routing pass and the timed runs: what serving holds
    memory_at_end: Memory  # after the switch phase, which loads every expert in turn
    # The native runner's packed-weight cache: whether it kept packed weights on disk, and the bytes its folder held at
    # the end of the round (0 when off); absent (None) on runners without one.
    weight_cache: bool | None = None
    weight_cache_bytes: int | None = None
    # The native runner's planned memory: the bytes of the arenas its graphs share (graph_loader.h PlannedArenas).
    planned_memory_bytes: int | None = None
    # The native runner's parking (graphs.h ExpertCache): how many evicted experts may park (-1: all), those parked
    # after the timed runs, and the bytes of their packed weights still mapped in then (0: all dropped).
    park_experts: int | None = None
    # libmobile_moe's runners: the expert graphs kept loaded, as the library resolved the options' cache_experts.
    cache_experts: int | None = None
    parked_experts: list[int] | None = None
    parked_packed_bytes_resident: int | None = None


# What a runner returns: the JSON object it printed, which RoundReport describes and validate_round checks.
RoundJson = dict[str, Any]
