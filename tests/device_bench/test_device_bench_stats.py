"""device_bench's pure parts: routing statistics, the round report and results.json schemas, the bench's settings,
and the report from given results."""

from __future__ import annotations

import copy
import os
import re

import numpy as np
import pytest

from mobile_moe.device_bench import routing_stats
from mobile_moe.device_bench.bench import BenchSettings, choose_runner
from mobile_moe.device_bench.report import markdown, write_report
from mobile_moe.device_bench.results import RoundReportError, run_record, validate_results, validate_round
from mobile_moe.device_bench.round_report import RoundReport
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.errors import UsageError
from mobile_moe.export.manifest_schema import (
    Composition,
    GraphEntry,
    Manifest,
    ModelSummary,
    QuantizationReport,
    QuantizedAccuracy,
)
from mobile_moe.library.options import MAX_THREADS


def test_expert_change_rate_and_lru_hit_rate_by_hand():
    sequence = [[0], [0], [1], [0], [2], [2]]
    assert routing_stats.expert_change_rate(sequence) == pytest.approx(3 / 5)
    # LRU of 1: hits at images 2 and 6. LRU of 2: also image 4 (0 still cached after 1). LRU of 3: same as 2.
    assert routing_stats.lru_hit_rate(sequence, 1) == pytest.approx(2 / 6)
    assert routing_stats.cache_hit_rates(sequence, 3) == pytest.approx({"1": 2 / 6, "2": 3 / 6, "3": 3 / 6})
    assert routing_stats.expert_histogram(sequence, 3) == [3, 1, 2]
    assert routing_stats.expert_change_rate([[1]]) is None


def test_lru_evicts_least_recently_used():
    # 0 1 0 2 0: with two slots, 2 evicts 1 (least recent), so the last 0 hits: hits at 3rd and 5th access.
    assert routing_stats.lru_hit_rate([[0], [1], [0], [2], [0]], 2) == pytest.approx(2 / 5)


def test_settings_refuse_zero_iterations():
    with pytest.raises(UsageError, match="iterations"):
        RoundSettings(iterations=0)
    with pytest.raises(UsageError, match=r"--cache-experts -2: out of range \(-1..4096\)"):
        RoundSettings(cache_experts=-2)



def fake_manifest(kind: str) -> Manifest:
    """The parts of a manifest a results record reads (unvalidated: no graph files, no input spec)."""
    model = {"name": "mobile-vmoe" if kind != "dense" else "vit", "image_size": 32, "patch_size": 8, "num_classes": 7,
             "depth": 3, "width": 32, "num_heads": 2}  # fmt: skip

    def graph(name: str, role: str, expert: int | None, size: int, params: int) -> GraphEntry:
        return GraphEntry.model_construct(
            name=name, role=role, expert=expert, file=f"{name}.pte", sha256="0" * 64, bytes=size, params=params
        )

    if kind == "dense":
        return Manifest.model_construct(
            backend="executorch", model=ModelSummary.model_construct(**model), num_experts=0,
            composition=Composition.model_construct(layout="dense"), graphs=[graph("dense", "dense", None, 1000, 250)],
            validation_top1=0.5, params_active_max=250,
        )  # fmt: skip
    model.update(num_experts=2, top_k=1, moe_layers=2)
    graphs = [graph("router", "router", None, 600, 150), *(graph(f"expert_{e}", "expert", e, 500, 125) for e in (0, 1))]
    return Manifest.model_construct(
        backend="executorch", model=ModelSummary.model_construct(**model), num_experts=2, top_k=1,
        composition=Composition.model_construct(layout="expert-paths"), graphs=graphs, validation_top1=0.6,
        params_active_max=275,  # the router and one expert
    )  # fmt: skip


def fake_summary(p50: float) -> dict:
    return {"p50": p50, "p90": p50 * 1.1, "p99": p50 * 1.3, "mean": p50 * 1.05, "min": p50 * 0.9, "max": p50 * 1.4,
            "samples": [p50 * 0.9, p50, p50 * 1.4]}  # fmt: skip


def fake_round(p50: float, experts: list[int]) -> dict:
    """A complete round report, the JSON object a runner would return."""
    memory = {"rss_bytes": 10, "peak_rss_bytes": 20, "pss_bytes": 15}
    row = {"gates": [1.0], "logits": [0.1, 0.9], "router_ms": 1.0, "expert_ms": 1.0, "load_ms": 0, "total_ms": 2.0,
           "cache_hit": True}  # fmt: skip
    return {
        "runner": "fake",
        "bundle": "b/moe",
        "threads": 1,
        "latency_ms": fake_summary(p50),
        "stages_ms": {"router": fake_summary(p50 / 2)},
        "load_ms": {"router": 3.0},
        "expert_load_ms": {"0": 2.0, "1": 4.0},
        "switch": {
            "ms": [5.0],
            "median_ms": 5.0,
            "load_median_ms": None,
            "first_run_median_ms": None,
            "warm_expert_run_median_ms": None,
        },  # fmt: skip
        "memory_at_start": memory,
        "memory_after_first_load": memory,
        "memory_after_warm": memory,
        "memory_at_end": {**memory, "pss_bytes": None},
        "images": [{**row, "experts": [e]} for e in experts],
        "graphs_loaded_after_routing": ["router", "expert_0"],
    }


def fake_report(p50: float, experts: list[int]) -> RoundReport:
    return validate_round(fake_round(p50, experts), "fake runner")


def test_a_complete_round_report_validates_nulls_and_extra_keys_included():
    report = dict(fake_round(10.0, [0, 1]), files_opened=["router.pte"])  # a runner's own extras pass through
    validated = validate_round(report, "fake runner")
    assert validated.model_dump(exclude_unset=True) == report and validated.files_opened == ["router.pte"]
    assert validated.images[1].experts == [1] and validated.memory_at_end.pss_bytes is None


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda r: r["switch"].pop("load_median_ms"), "returned a round report without switch.load_median_ms"),
        (lambda r: r.pop("memory_after_warm"), "without memory_after_warm"),
        (lambda r: r["images"][1].pop("cache_hit"), "without images[1].cache_hit"),
        (lambda r: r["latency_ms"].update(p90="slow"), "field latency_ms.p90 is str; RoundReport wants float"),
        (lambda r: r["stages_ms"]["router"].update(p99=1.0), "latency percentiles out of order"),  # results.json's rule
        (lambda r: r["stages_ms"]["router"].update(samples=None), "samples is NoneType; RoundReport wants list"),
        (lambda r: r.update(threads=True), "field threads is bool; RoundReport wants int"),
        (lambda r: r.update(load_ms={}), "load_ms is empty"),
        (lambda r: r.update(switch=[]), "round report switch is not an object"),
    ],
)
def test_a_round_report_missing_or_mistyped_field_is_refused_by_name(change, fragment):
    report = copy.deepcopy(fake_round(10.0, [0, 1]))
    change(report)
    with pytest.raises(RoundReportError, match="fake runner") as refused:
        validate_round(report, "fake runner")
    assert fragment in str(refused.value) and "\n" not in str(refused.value)
    assert isinstance(refused.value, UsageError)  # the CLI's one line and status 2
    with pytest.raises(RoundReportError, match="is not an object"):
        validate_round(["not", "a", "report"], "fake runner")


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"rounds": 0}, "--rounds 0: must be from 1 to 1000"),
        ({"rounds": 10**20}, "--rounds 100000000000000000000: must be from 1 to 1000"),
        ({"pause_s": -1.0}, "--pause -1.0: seconds between rounds"),
        ({"pause_s": 4000.0}, "--pause 4000.0"),
        ({"images": 0}, "--images 0: must be at least 1"),
        ({"data": "random:abc"}, "--data random:abc: the seed must be a non-negative integer"),
        ({"runtime": "tflite"}, "--runtime 'tflite': choose one of executorch, onnxruntime, native, coreml"),
        ({"device": "iphone"}, "--device 'iphone': use host, android[:SERIAL], arm64-emulated"),
        ({"device": "host:1234"}, "--device 'host:1234'"),
        ({"runner": "/nonexistent/runner"}, "--runner /nonexistent/runner: no such file"),
        ({"device": "android", "runtime": "native"}, "--device android needs --runner PATH"),
        ({"device": "android:ABC", "runtime": "onnxruntime"}, "--device android runs the native runner only"),
    ],
)
def test_bench_settings_refuse_bad_values_in_one_line(changes, fragment):
    with pytest.raises(UsageError) as refused:
        BenchSettings(RoundSettings(iterations=2), **changes)
    assert fragment in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"iterations": 0}, "--iterations 0: must be from 1"),
        ({"iterations": 10**20}, "to 1000000"),  # a worker ran it until it was killed; the native runner refused it
        ({"warmup": 10**7}, "--warmup 10000000: must be from 0 to 1000000"),
        ({"switch_repeats": -1}, "--switch-repeats -1: must be from 0 (no switch timing) to 1000000"),
    ],
)
def test_round_settings_are_bounded_as_the_native_runner_bounds_them(changes, fragment):
    with pytest.raises(UsageError, match=re.escape(fragment)):
        RoundSettings(**changes)


@pytest.mark.parametrize(("threads", "fragment"), [(-1, "--threads -1"), (100_000, "--threads 100000")])
def test_thread_counts_beyond_the_librarys_bound_are_refused(threads, fragment):
    """100,000 inference threads once exhausted the machine's processes (onnxruntime started them all)."""
    with pytest.raises(UsageError, match=f"{fragment}: out of range \\(0..{MAX_THREADS}\\)"):
        RoundSettings(threads=threads)
    assert RoundSettings(threads=MAX_THREADS).threads == MAX_THREADS


def test_bench_settings_defaults_and_json():
    settings = BenchSettings(RoundSettings(iterations=7), data="random:3", pause_s=0)
    assert settings.runtime is None and settings.device == "host" and settings.rounds == 3
    assert settings.as_json() == {"iterations": 7, "warmup": 5, "switch_repeats": 2, "threads": 1, "cache_experts": -1,
                                  "park_experts": -1, "cache_margin": 0.0, "weight_cache_dir": None,
                                  "weight_cache_limit_mib": 1024, "prefetch": 1, "data": "random:3", "images": 32,
                                  "order": "stratified", "seed": 0, "pause_s": 0}  # fmt: skip


def test_one_function_picks_the_runner_for_runtime_and_device(tmp_path):
    from mobile_moe.device_bench.android import AndroidRunner
    from mobile_moe.device_bench.native_runner import NativeRunner
    from mobile_moe.device_bench.python_worker import PythonWorker

    assert choose_runner("native") == NativeRunner(None)
    assert choose_runner("onnxruntime") == PythonWorker("onnxruntime")
    assert choose_runner("executorch").name == "executorch worker"
    assert choose_runner("native", "android:SER1", tmp_path / "runner") == AndroidRunner("SER1", tmp_path / "runner")


def test_run_record_medians_spread_and_schema(tmp_path):
    rounds = [fake_report(p50, [0, 1, 1, 0]) for p50 in (10.0, 11.0, 14.0)]
    record = run_record("b/moe", fake_manifest("moe"), "native", "host", rounds, "random:0")
    assert record["latency_ms"]["p50"] == 11.0  # median across rounds
    assert record["spread"]["relative"] == pytest.approx(4 / 11) and record["spread"]["wide"]
    assert record["load_ms"] == {"router": 3.0, "expert": 3.0}
    assert record["bytes_loaded_per_image"] == 600 + 500
    assert record["expert_change_rate"] == pytest.approx(2 / 3)
    assert record["cache_hit_rate"] == pytest.approx({"1": 1 / 4, "2": 2 / 4})  # 0 1 1 0: LRU of one hits once
    validate_results({"runs": [record]})
    broken = dict(record, latency_ms={"p50": 3.0, "p90": 2.0, "p99": 4.0, "mean": 3.0})
    with pytest.raises(ValueError, match="out of order"):
        validate_results({"runs": [broken]})
    with pytest.raises(ValueError, match="lacks"):
        validate_results({"runs": [{k: v for k, v in record.items() if k != "switch_ms"}]})


def test_report_files_and_side_by_side(tmp_path):
    moe = run_record("b/moe", fake_manifest("moe"), "native", "host", [fake_report(10.0, [0, 1])], "random:0")
    dense = run_record("b/dense", fake_manifest("dense"), "native", "host", [fake_report(9.0, [])], "random:0")
    written = write_report({"runs": [moe, dense], "host": "test", "rounds": 1}, tmp_path)
    assert {path.name for path in written} == {"report.md", "latency.png", "memory.png", "accuracy_vs_flops.png"}
    text = (tmp_path / "report.md").read_text()
    assert "ratio 1.111" in text  # 10 / 9: MoE vs dense p50, side by side
    assert all(path.stat().st_size > 0 for path in written)
    assert "The stream" not in text  # no warm run of the switched expert measured: no cost over a hit to state


def test_the_report_says_how_often_the_stream_switched_and_what_a_switch_added():
    switching = fake_round(10.0, [0, 1, 1, 0])
    switching["switch"]["warm_expert_run_median_ms"] = 2.0  # a switch (5 ms) adds 3 ms over a hit
    moe = run_record("b/moe", fake_manifest("moe"), "native", "host", [validate_round(switching, "fake")], "random:0")
    text = markdown({"runs": [moe], "host": "test", "rounds": 1})
    assert (
        "- moe (native, host): the expert changed on 67% of consecutive images; each change added 3.00 ms over a hit "
        "(0.3x the warm p50 of 10.00 ms), about 2.00 ms per image on average"
    ) in text
    steady = fake_round(10.0, [1, 1, 1, 1])  # a stream that never changes: the switch was measured apart
    steady["switch"]["warm_expert_run_median_ms"] = 2.0
    moe = run_record("b/moe", fake_manifest("moe"), "native", "host", [validate_round(steady, "fake")], "random:0")
    assert (
        "- moe (native, host): the expert never changed between consecutive images of random:0; a change (measured "
        "apart) adds 3.00 ms over a hit (0.3x the warm p50 of 10.00 ms)"
    ) in markdown({"runs": [moe], "host": "test", "rounds": 1})


def test_a_quantized_bundles_top1_is_named_its_checkpoints_and_export_measured_the_bundle_itself():
    measured = {"images": 512, "fp32_top1": 0.903, "quantized_top1": 0.896, "top1_change": -0.007,
                "prediction_agreement": 0.98}  # fmt: skip
    quantized = QuantizationReport(validation=QuantizedAccuracy(**measured))
    manifest = fake_manifest("moe").model_copy(update={"test_top1": 0.893, "quantization": quantized})
    record = run_record("b/moe-int8", manifest, "native", "host", [fake_report(10.0, [0, 1])], "random:0")
    assert record["accuracy"] == 0.893 and record["quantized_validation"] == {"measured": True, "reason": None,
                                                                              **measured}  # fmt: skip
    validate_results({"runs": [record]})
    with pytest.raises(ValueError, match="quantized_validation"):
        validate_results({"runs": [dict(record, quantized_validation={**measured, "quantized_top1": 2.0})]})
    text = markdown({"runs": [record], "host": "test", "rounds": 1})
    assert "| 89.3% (test, fp32) |" in text
    assert "- moe-int8: 89.6% on 512 validation images, against 90.3% in fp32 (-0.7 points)" in text
    unmeasured = QuantizationReport(validation=QuantizedAccuracy(measured=False, reason="no validation split given"))
    manifest = manifest.model_copy(update={"quantization": unmeasured})
    record = run_record("b/moe-int8", manifest, "native", "host", [fake_report(10.0, [0, 1])], "random:0")
    assert record["quantized_validation"] == {"measured": False, "reason": "no validation split given", "images": None,
                                              "fp32_top1": None, "quantized_top1": None, "top1_change": None,
                                              "prediction_agreement": None}  # fmt: skip
    validate_results({"runs": [record]})
    text = markdown({"runs": [record], "host": "test", "rounds": 1})
    assert "- moe-int8: not measured at export: no validation split given" in text
    fp32 = run_record("b/moe", fake_manifest("moe"), "native", "host", [fake_report(10.0, [0, 1])], "random:0")
    assert "quantized_validation" not in fp32 and "fp32)" not in markdown({"runs": [fp32], "host": "test", "rounds": 1})


def test_an_emulated_runs_parity_with_the_host_is_counted_and_reported():
    from mobile_moe.device_bench.results import host_parity

    host = fake_round(10.0, [0, 1, 1])
    emulated = fake_round(10.0, [0, 1, 0])  # the third image routed elsewhere, and classed otherwise
    emulated["images"][1]["logits"] = [0.1, 0.90004]
    emulated["images"][2]["logits"] = [0.9, 0.1]
    parity = host_parity(validate_round(emulated, "arm"), validate_round(host, "host"), reference="executorch")
    assert parity == {"reference": "executorch", "images": 3, "max_abs_logit_diff": pytest.approx(0.8),
                      "same_class": 2, "same_experts": 2}  # fmt: skip
    moe = run_record("b/moe", fake_manifest("moe"), "native", "arm64-emulated", [fake_report(9.0, [0])], "random:0")
    record = dict(moe, emulated=True, host_parity=parity)
    validate_results({"runs": [record]})
    with pytest.raises(ValueError, match="host_parity.same_class"):
        validate_results({"runs": [dict(record, host_parity={**parity, "same_class": -1})]})
    text = markdown({"runs": [record], "host": "test", "rounds": 1})
    assert "| moe | executorch | 8.0e-01 | 2/3 | 2/3 |" in text and "against this host's below" in text


@pytest.mark.parametrize(("monolithic_p50", "axes"), [(300.0, 2), (20.0, 1)], ids=["30x: own axis", "2x: shared"])
def test_a_monolithic_bundle_many_times_slower_gets_an_axis_of_its_own(monolithic_p50, axes):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mobile_moe.device_bench.report import _latency_plot

    dense = run_record("b/dense", fake_manifest("dense"), "native", "host", [fake_report(10.0, [])], "random:0")
    mono = run_record("b/mono", fake_manifest("dense"), "native", "host", [fake_report(monolithic_p50, [])], "r:0")
    figure = _latency_plot(plt, {"runs": [dense, dict(mono, kind="monolithic")], "host": "test"})
    assert len(figure.axes) == axes
    plt.close(figure)


def test_the_latency_plot_marks_the_runs_the_report_calls_wide():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mobile_moe.device_bench.report import _latency_plot

    steady = run_record("b/dense", fake_manifest("dense"), "native", "host", [fake_report(9.0, [])], "random:0")
    noisy = dict(steady, bundle_name="noisy", spread={"relative": 0.25, "wide": True})
    figure = _latency_plot(plt, {"runs": [steady, noisy], "host": "test"})
    axis = figure.axes[0]
    assert [bar.get_hatch() for bar in axis.patches] == [None, "//"]
    assert [text.get_text() for text in axis.texts] == ["WIDE 25%"] and "WIDE" in axis.get_title()
    plt.close(figure)


def test_a_round_passes_on_only_the_library_options_that_differ_from_its_defaults():
    """What a runner leaves alone is mm_default_options' value, so a round at its defaults runs what an app gets; the
    others reach the native runner and a Python worker alike, in the library's encoding."""
    from mobile_moe.device_bench.native_runner import runner_command
    from mobile_moe.device_bench.python_worker import worker_command

    assert not {"--threads", "--cache-experts", "--park-experts", "--weight-cache-dir"} & set(
        runner_command("./runner", "bundle", "images.f32", RoundSettings())
    )
    settings = RoundSettings(park_experts=0, weight_cache_dir="", cache_experts=0)
    native = runner_command("./runner", "bundle", "images.f32", settings)
    assert native[-8:] == ["--cache-experts", "0", "--park-experts", "0", "--weight-cache-dir", "", "--input",
                           "images.f32"]  # fmt: skip
    assert native[0] == os.path.abspath("runner")  # "./runner" run as a bare name would be looked up on PATH
    worker = worker_command("bundle", "executorch", "images.f32", settings)
    assert worker[worker.index("--cache-experts"):][:6] == native[-8:-2]


def test_a_data_workload_draws_across_classes_seeded_and_named():
    """A folder's val split in class order: `folder` takes its first images (one class), `stratified` every class
    as equally as the count allows, `shuffled` a random sample; both seeded, both in an order whose expert (here the
    class) changes on most consecutive images."""
    from mobile_moe.device_bench.workload import draw_indices

    labels = [c for c in range(10) for _ in range(12)]  # sorted by class, as ImageFolder lists a folder
    assert [labels[i] for i in draw_indices(labels, 32, "folder", 0)] == [0] * 12 + [1] * 12 + [2] * 8
    stratified = draw_indices(labels, 32, "stratified", 0)
    counts = np.bincount([labels[i] for i in stratified], minlength=10)
    assert len(set(stratified.tolist())) == 32 and counts.min() == 3 and counts.max() == 4
    assert np.array_equal(stratified, draw_indices(labels, 32, "stratified", 0))
    assert not np.array_equal(stratified, draw_indices(labels, 32, "stratified", 1))
    classes = [labels[i] for i in stratified]
    assert routing_stats.expert_change_rate([[c] for c in classes]) > 0.7
    shuffled = draw_indices(labels, 200, "shuffled", 0)
    assert sorted(shuffled.tolist()) == list(range(120))  # a count beyond the split: all of it, once each
    with pytest.raises(UsageError, match="--order alphabetical: choose one of stratified, shuffled, folder"):
        draw_indices(labels, 8, "alphabetical", 0)
    with pytest.raises(UsageError, match="--order"):
        BenchSettings(order="sorted")


def test_the_workloads_seed_and_order_reach_the_draw(monkeypatch):
    from mobile_moe.device_bench import workload

    seen = {}
    monkeypatch.setattr(workload, "data_workload", lambda *args, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(workload, "check_fits_memory", lambda count, shape: None)  # the fake has no input spec
    manifest = type("Fake", (), {"input": type("Input", (), {"shape": [1, 3, 8, 8]})})()
    workload.make_workload("digits", manifest, 8, bundle="b", order="shuffled", seed=5)
    assert seen == {"bundle": "b", "order": "shuffled", "seed": 5}
