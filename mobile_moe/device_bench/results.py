"""results.json: one record per (bundle, runtime, device), aggregated over rounds, in docs/formats.md.

A results.json states its format version first (VERSION); the one reader of the file (bench.bench_files, which
decides whether a --out holds an earlier bench) refuses another version, or none, in one line.

A round is one runner process (its JSON). Each headline number is the median across rounds; `spread` says how far
the rounds' warm p50 latencies lie apart, and flags it when that exceeds SPREAD_FLAG of the median, because on a
shared or thermally throttled machine one run can mislead.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mobile_moe.device_bench import routing_stats
from mobile_moe.device_bench.round_report import Latency, RoundReport, SwitchParts
from mobile_moe.errors import UsageError
from mobile_moe.export.manifest_schema import GraphEntry, Manifest, QuantizedAccuracy
from mobile_moe.models.costs import costs, every_expert_flops
from mobile_moe.models.registry import config_from_dict

VERSION = 1  # results.json's format version
SPREAD_FLAG = 0.10  # (max - min) / median of the rounds' p50 above this: the rounds disagree, numbers are noisy


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _config(manifest: Manifest):
    """The manifest's model config as written, or None for a model family this toolkit cannot count."""
    try:
        return config_from_dict(manifest.model.model_dump(exclude_unset=True))
    except Exception:  # an unknown model family: report the counts as unknown rather than guess
        return None


def _costs(manifest: Manifest):
    """Parameter and FLOP counts from the manifest's model config (mobile_moe.models.costs), or None if it cannot
    say."""
    config = _config(manifest)
    return costs(config) if config is not None else None


def _loaded_per_image(manifest: Manifest, sequence: list[list[int]], size: Callable[[GraphEntry], int]) -> float:
    """Mean over images of `size(graph)` (bytes, parameters) summed over the graphs each image needs loaded: every graph
    that is not an expert's (router, shared block halves, head, or the one dense / monolithic / whole graph) plus the
    graphs of the experts it chose. A whole per-token bundle has no expert graphs: each image loads the whole graph,
    every expert included, whichever experts its tokens used."""
    fixed, per_expert = manifest.resident_and_per_expert(size)
    if not per_expert or not sequence:
        return float(fixed)
    return statistics.mean(fixed + sum(per_expert[e] for e in experts) for experts in sequence)


def bytes_per_image(manifest: Manifest, sequence: list[list[int]]) -> float:
    """Graph bytes one image needs loaded: the router (or the single graph) plus its chosen experts, averaged."""
    return _loaded_per_image(manifest, sequence, lambda graph: graph.load_bytes)


def params_per_image(manifest: Manifest, sequence: list[list[int]]) -> float:
    """Parameters (weights) of the graphs one image needs loaded, averaged: set beside params_active, what it
    computes with, this says what a phone holds for it (a whole per-token bundle: every expert, always)."""
    return _loaded_per_image(manifest, sequence, lambda graph: graph.params)


class RoundReportError(UsageError):
    """A runner's round report lacks a field RoundReport requires, or holds the wrong kind of value in one. A
    UsageError (one line, status 2) because the usual cause is a --runner binary built from other sources."""


def _where(location: tuple) -> str:
    """pydantic's error location as the report's own path: images[1].cache_hit."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in location).lstrip(".")


def _round_report_error(error: ValidationError, runner: str) -> RoundReportError:
    first = error.errors(include_url=False)[0]
    where, value = _where(first["loc"]), first.get("input")
    if first["type"] == "missing":
        return RoundReportError(
            f"{runner} returned a round report without {where}: every runner must give it (null when it cannot "
            "measure it)"
        )
    if first["type"] in ("model_type", "model_attributes_type", "dict_type") and isinstance(value, list | str):
        return RoundReportError(f"{runner}: round report {where or 'itself'} is not an object")
    if first["type"] == "value_error":  # a rule across fields (Latency's order): its own words
        return RoundReportError(f"{runner}: round report field {where}: {first['msg'].removeprefix('Value error, ')}")
    expected = first["type"].removesuffix("_type").removesuffix("_parsing").replace("model", "object")
    found = type(value).__name__
    return RoundReportError(f"{runner}: round report field {where} is {found}; RoundReport wants {expected}")


def validate_round(report: object, runner: str) -> RoundReport:
    """`report`, a runner's JSON object, as a RoundReport (mobile_moe/device_bench/round_report.py), or RoundReportError
    naming the runner and the first field it lacks or holds the wrong kind of value in. Every round goes through here
    before results reads it."""
    if not isinstance(report, dict):
        raise RoundReportError(f"{runner}: round report itself is not an object")
    try:
        validated = RoundReport.model_validate(report)
    except ValidationError as error:
        raise _round_report_error(error, runner) from None
    if not validated.load_ms:
        raise RoundReportError(f"{runner}: round report field load_ms is empty; it must time the graph loaded first")
    return validated


def _parts(parts: SwitchParts | None) -> dict | None:
    return parts.model_dump() if parts is not None else None


def summarize_round(round_: RoundReport) -> dict:
    """The few numbers of one round that the aggregate and the spread use."""
    latency, switch = round_.latency_ms, round_.switch
    memory = round_.memory_after_warm  # serving memory: before the switch phase loads every expert in turn
    return {
        "latency_ms": {key: getattr(latency, key) for key in ("p50", "p90", "p99", "mean")},
        "load_ms_router": next(iter(round_.load_ms.values())),
        "expert_load_ms": _median(list(round_.expert_load_ms.values())),
        "switch_ms": switch.median_ms,
        "switch_load_ms": switch.load_median_ms,
        "switch_first_run_ms": switch.first_run_median_ms,
        "switch_warm_expert_run_ms": switch.warm_expert_run_median_ms,
        "switch_parts_ms": _parts(switch.parts_median_ms),
        "switch_cold_ms": switch.cold.median_ms if switch.cold else None,
        "switch_cold_parts_ms": _parts(switch.cold.parts_median_ms) if switch.cold else None,
        "peak_rss_bytes": memory.peak_rss_bytes,
        "pss_bytes": memory.pss_bytes,
        "rss_after_load_bytes": round_.memory_after_first_load.rss_bytes,
        "model_peak_bytes": _above(memory.peak_rss_bytes, round_.memory_at_start.rss_bytes),
        "weight_cache_bytes": round_.weight_cache_bytes,
    }


def _above(value: int | None, base: int | None) -> int | None:
    """`value - base`, the model's share of a process's memory over what it held before loading anything."""
    return None if value is None or base is None else value - base


def run_record(
    bundle: str | Path, manifest: Manifest, runtime: str, device: str, rounds: list[RoundReport], workload_source: str
) -> dict:
    """The results.json record for one (bundle, runtime, device) from its rounds' validated reports."""
    first = rounds[0]
    summaries = [summarize_round(round_) for round_ in rounds]
    sequence = [row.experts for row in first.images]
    split = manifest.kind == "split"
    return {
        "bundle": str(bundle),
        # For tables and plots: a folder name whose bytes are not UTF-8 shows its odd bytes escaped (\xff).
        "bundle_name": os.fsencode(Path(bundle).name).decode("utf-8", "backslashreplace"),
        "model": manifest.model.name,
        "kind": manifest.kind,
        "backend": manifest.backend,
        "runtime": runtime,
        "device": device,
        "threads": first.threads,
        # Expert graphs the run kept loaded, as the library resolved its cache_experts (None: a runtime that reports
        # none)
        "cache_experts": first.cache_experts,
        "rounds": len(rounds),
        "images": len(sequence),
        "workload": workload_source,
        **_timings(rounds, summaries, split=split),
        "peak_rss_bytes": _median([s["peak_rss_bytes"] for s in summaries]),
        "pss_bytes": _median([s["pss_bytes"] for s in summaries]),
        "rss_after_load_bytes": _median([s["rss_after_load_bytes"] for s in summaries]),
        "model_peak_bytes": _median([s["model_peak_bytes"] for s in summaries]),
        **_sizes(manifest, sequence),
        **_accuracy(manifest),
        "expert_change_rate": routing_stats.expert_change_rate(sequence) if split else None,
        "cache_hit_rate": routing_stats.cache_hit_rates(sequence, manifest.num_experts) if split else {},
        "expert_histogram": routing_stats.expert_histogram(sequence, manifest.num_experts) if split else [],
        # The native runner's packed-weight cache: on or off (None: a runtime without one), and what it held after
        # the last round (the first round of a fresh cache packs; later rounds map).
        "weight_cache": first.weight_cache,
        "weight_cache_bytes": summaries[-1]["weight_cache_bytes"],
        "spread": _spread([s["latency_ms"]["p50"] for s in summaries]),
        "per_round": summaries,
    }


def _accuracy(manifest) -> dict:
    """The top-1 a report compares bundles with, and its split: the test split's (export measured it) where the
    manifest has it, else the run's best validation top-1 (data without a test split), else none (no run). Both are
    the fp32 checkpoint's; for a quantized bundle, what export measured of the bundle itself on validation images
    (the manifest's quantization.validation, or why it measured nothing) goes beside them."""
    validation = manifest.quantization and manifest.quantization.validation
    measured = validation.model_dump(mode="json") if validation else None
    if manifest.test_top1 is not None:
        found = {"accuracy": manifest.test_top1, "accuracy_split": "test"}
    elif manifest.validation_top1 is not None:
        found = {"accuracy": manifest.validation_top1, "accuracy_split": "validation"}
    else:
        found = {"accuracy": None, "accuracy_split": None}
    return found | ({"quantized_validation": measured} if manifest.quantization is not None else {})


def _timings(rounds: list[RoundReport], summaries: list[dict], *, split: bool) -> dict:
    """Latency, stage, load and switch times: each the median over the rounds (a switch only for split bundles)."""
    latency = {key: _median([s["latency_ms"][key] for s in summaries]) for key in ("p50", "p90", "p99", "mean")}
    switch_ms = _median([s["switch_ms"] for s in summaries])
    return {
        "latency_ms": latency,
        "stages_ms": {
            stage: _median([r.stages_ms[stage].p50 for r in rounds if stage in r.stages_ms])
            for stage in rounds[0].stages_ms
        },
        "load_ms": {
            "router": _median([s["load_ms_router"] for s in summaries]),
            "expert": _median([s["expert_load_ms"] for s in summaries]) if split else None,
        },
        "switch_ms": switch_ms if split else None,
        "switch": _switch(rounds, summaries, switch_ms if split else None, latency["p50"]),
    }


def _switch(rounds: list[RoundReport], summaries: list[dict], switch_ms: float | None, p50: float) -> dict:
    """The switch's parts; `added_ms`: what a switch costs over a hit (switch - the same expert's warm run), the
    number that prefetching or a warm packed-weight cache must bring down; `cold_*`: from an empty cache."""
    warm_run = _median([s["switch_warm_expert_run_ms"] for s in summaries])
    cold_ms = _median([s["switch_cold_ms"] for s in summaries])
    switch = rounds[0].switch

    def added(ms: float | None) -> float | None:
        return ms - warm_run if ms is not None and warm_run is not None else None

    def ratio(ms: float | None) -> float | None:
        return ms / p50 if ms is not None and p50 else None

    return {
        "cache": switch.cache,
        "weights": switch.weights,
        "load_ms": _median([s["switch_load_ms"] for s in summaries]),
        "first_run_ms": _median([s["switch_first_run_ms"] for s in summaries]),
        "warm_expert_run_ms": warm_run,
        "vs_warm_p50": ratio(switch_ms),
        "added_ms": added(switch_ms),
        "added_vs_warm_p50": ratio(added(switch_ms)),
        "parts_ms": _median_parts([s["switch_parts_ms"] for s in summaries]),
        "cold_ms": cold_ms,
        "cold_added_vs_warm_p50": ratio(added(cold_ms)),
        "cold_parts_ms": _median_parts([s["switch_cold_parts_ms"] for s in summaries]),
    }


def _median_parts(parts: list[dict | None]) -> dict | None:
    """Each part's median over the rounds; None when no round took its switches apart."""
    measured = [p for p in parts if p]
    return {key: _median([p[key] for p in measured]) for key in measured[0]} if measured else None


def _sizes(manifest: Manifest, sequence: list[list[int]]) -> dict:
    """What an image loads and computes with: bytes and parameters, against the model's counts."""
    counts = _costs(manifest)
    bytes_image = bytes_per_image(manifest, sequence)
    active = manifest.params_active_max  # what one image computes with, worst case (export's mobile_moe.models.costs)
    active_bytes = active * 4 if active else None  # fp32 weights
    params_image = params_per_image(manifest, sequence)
    return {
        "bytes_loaded_per_image": bytes_image,
        "bundle_bytes": manifest.bundle_bytes(),
        "params_active": active,
        "params_loaded_per_image": params_image,
        "params_loaded_vs_active": params_image / active if active else None,
        "params_total": counts.params_total if counts else None,
        "flops": _flops(manifest, counts),
        "bytes_loaded_vs_active_params": bytes_image / active_bytes if active_bytes else None,
    }


def _flops(manifest: Manifest, counts) -> int | None:
    """FLOPs per image of what the bundle computes: a monolithic graph runs every expert on every image."""
    if counts is None:
        return None
    if any(graph.role == "monolithic" for graph in manifest.graphs):
        return every_expert_flops(_config(manifest))
    return counts.flops


def _spread(p50s: list[float]) -> dict:
    """How far the rounds' warm p50 latencies lie apart, flagged beyond SPREAD_FLAG of their median."""
    relative = (max(p50s) - min(p50s)) / statistics.median(p50s) if len(p50s) > 1 else 0.0
    return {"latency_p50_ms": p50s, "relative": relative, "wide": len(p50s) > 1 and relative > SPREAD_FLAG}


class _Loads(BaseModel):
    router: float | None
    expert: float | None


class HostParity(BaseModel):
    """An emulated run's answers against this host's on the same images (docs/formats.md, results.json)."""

    reference: str  # the runtime that gave the host's answers
    images: Annotated[int, Field(ge=1)]
    max_abs_logit_diff: Annotated[float, Field(ge=0)]
    same_class: Annotated[int, Field(ge=0)]
    same_experts: Annotated[int, Field(ge=0)]


def host_parity(run: RoundReport, host: RoundReport, *, reference: str) -> dict:
    """How a round's per-image logits and experts agree with `host`'s round on the same images (`reference`: the
    runtime that ran `host`): the largest logit difference, and how many images got the same class and experts."""
    if len(run.images) != len(host.images):
        raise ValueError(f"parity needs the same images: {len(run.images)} against {len(host.images)}")
    pairs = list(zip(run.images, host.images, strict=True))
    differences = [abs(a - b) for ours, theirs in pairs for a, b in zip(ours.logits, theirs.logits, strict=True)]
    return {
        "reference": reference,
        "images": len(pairs),
        "max_abs_logit_diff": max(differences),
        "same_class": sum(_top1(ours.logits) == _top1(theirs.logits) for ours, theirs in pairs),
        "same_experts": sum(ours.experts == theirs.experts for ours, theirs in pairs),
    }


def _top1(logits: list[float]) -> int:
    return max(range(len(logits)), key=logits.__getitem__)


class RunRecord(BaseModel):
    """The fields of a results.json run that every reader relies on (docs/formats.md); the rest pass through."""

    model_config = ConfigDict(extra="allow")

    bundle: str
    model: str | None
    runtime: str
    device: str
    threads: int | None
    latency_ms: Latency
    load_ms: _Loads
    switch_ms: float | None
    peak_rss_bytes: float | None
    bytes_loaded_per_image: float
    params_active: int
    expert_change_rate: float | None
    cache_hit_rate: dict[str, float]  # cache size -> hit rate
    accuracy: Annotated[float, Field(ge=0, le=1)] | None = None
    accuracy_split: Literal["test", "validation"] | None = None
    quantized_validation: QuantizedAccuracy | None = None  # quantized bundles only: what export measured of it
    host_parity: HostParity | None = None  # emulated runs only


class ResultsFile(BaseModel):
    model_config = ConfigDict(extra="allow")

    runs: list[RunRecord] = Field(min_length=1)


def validate_results(results: dict) -> None:
    """Raise ValueError naming the first way `results` departs from docs/formats.md (results.json)."""
    try:
        ResultsFile.model_validate(results)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        location = first["loc"]
        if location[:1] != ("runs",) or len(location) < 2:
            raise ValueError(f"results.json needs a non-empty list 'runs' ({first['msg']})") from None
        where = f"run {location[1]}"
        if first["type"] == "missing":
            raise ValueError(f"{where} lacks {_where(location[2:])}") from None
        message = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"{where}: {_where(location[2:]) or 'the record'}: {message}") from None
