"""The Python bench worker (ExecuTorch Python bindings, ONNX Runtime): its report is a RoundReport with every stage,
the switch timing honours --switch-repeats, and --threads reaches every session it opens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import one_torch_thread

from mobile_moe.device_bench import python_worker
from mobile_moe.device_bench.results import validate_round
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.device_bench.workload import random_workload, write_raw
from mobile_moe.export.manifest import read_manifest


@pytest.fixture(params=["executorch", "onnxruntime"])
def split_bundle(request, bundle, onnx_bundle) -> tuple[Path, str]:
    return (bundle if request.param == "executorch" else onnx_bundle), request.param


def measure(bundle: Path, runtime: str, tmp_path: Path, **changes) -> dict:
    """One round in this process, on eight random images."""
    images = write_raw(random_workload(read_manifest(bundle).input.shape, count=8, seed=3), tmp_path / "x.f32")
    settings = RoundSettings(**{"iterations": 6, "warmup": 1, "threads": 1, "switch_repeats": 2, **changes})
    with one_torch_thread():  # the worker sets torch's threads for its process: this one's go back after
        return python_worker.measure(bundle, runtime, images, settings)


def test_report_times_the_router_and_the_expert_stage(split_bundle, tmp_path):
    bundle, runtime = split_bundle
    report = measure(bundle, runtime, tmp_path)
    validate_round(report, f"{runtime} worker")  # every field RoundReport requires, of the right kinds
    stages = report["stages_ms"]
    assert stages["router"]["p50"] > 0 and stages["expert"]["p50"] > 0  # the expert stage was always 0
    for row in report["images"]:  # the stages are parts of the image's wall time
        assert 0 < row["router_ms"] and row["router_ms"] + row["expert_ms"] <= row["total_ms"]


@pytest.mark.parametrize("repeats", [0, 1, 3])
def test_switch_timing_follows_switch_repeats(bundle, tmp_path, repeats):
    report = measure(bundle, "executorch", tmp_path, switch_repeats=repeats)
    switch = report["switch"]
    experts_used = {row["experts"][0] for row in report["images"]}
    assert len(experts_used) >= 2  # mean pooling: random images reach different experts
    if repeats == 0:
        assert switch["ms"] == [] and "switch timing off" in switch["note"]
        assert switch["load_median_ms"] is None and switch["first_run_median_ms"] is None  # null, not left out
    else:
        assert len(switch["ms"]) == repeats * len(experts_used)  # one cold switch per expert per repeat
        assert switch["load_median_ms"] > 0 and switch["first_run_median_ms"] > 0
        assert switch["warm_expert_run_median_ms"] > 0


def test_threads_reach_every_onnxruntime_session(onnx_bundle, tmp_path, monkeypatch):
    """Without it each session made its own thread pool: eleven graphs fought over the cores (issue 12)."""
    from mobile_moe.export import loaded_graphs

    threads_of_sessions = []

    def opened(path, graph, threads=None):
        runner = loaded_graphs.OnnxGraph(path, graph, threads)
        threads_of_sessions.append(runner.session.get_session_options().intra_op_num_threads)
        return runner

    monkeypatch.setitem(loaded_graphs.GRAPH_OF_BACKEND, "onnx", opened)
    measure(onnx_bundle, "onnxruntime", tmp_path, threads=2)
    assert len(threads_of_sessions) >= 3  # the router and at least two experts, for the timing and the switch
    assert set(threads_of_sessions) == {2}


@pytest.mark.slow  # two rounds, each a fresh worker process (12 s); the bench CLI's test runs the same flow
def test_benchmark_with_bench_settings_writes_results_that_validate(bundle, tmp_path):
    from mobile_moe.device_bench.bench import BenchSettings, benchmark
    from mobile_moe.device_bench.results import validate_results

    settings = BenchSettings(RoundSettings(iterations=3, warmup=0, switch_repeats=1), runtime="executorch", rounds=2,
                             pause_s=0, images=4)  # fmt: skip
    lines: list[str] = []
    results = benchmark([bundle], settings, tmp_path / "bench", log=lines.append)
    validate_results(results)
    assert json.loads((tmp_path / "bench" / "results.json").read_text()) == json.loads(json.dumps(results))
    (run,) = results["runs"]
    assert run["bundle"] == str(bundle) and run["runtime"] == "executorch" and run["device"] == "host"
    assert run["rounds"] == 2 and run["images"] == 4 and len(lines) == 2
    assert run["raw_first_round"]["runner"] == "python-executorch"
    assert results["settings"]["iterations"] == 3 and results["settings"]["pause_s"] == 0
    assert (tmp_path / "bench" / "report.md").stat().st_size > 0


class IncompleteRunner:
    """A runner whose report lacks one field RoundReport requires."""

    name = "incomplete runner"

    def run_round(self, bundle, images, settings):
        report = python_worker.measure(bundle, "executorch", images, settings)
        del report["memory_after_warm"]
        return report


def test_benchmark_refuses_a_runner_report_without_a_field_by_name(bundle, tmp_path, monkeypatch):
    from mobile_moe.device_bench import bench
    from mobile_moe.device_bench.results import RoundReportError

    monkeypatch.setattr(bench, "choose_runner", lambda runtime, device, runner: IncompleteRunner())
    settings = bench.BenchSettings(RoundSettings(iterations=1, warmup=0, switch_repeats=0), rounds=1, images=2)
    with pytest.raises(RoundReportError, match="incomplete runner returned a round report without memory_after_warm"):
        bench.benchmark([bundle], settings, tmp_path / "bench", log=lambda message: None)
    assert not (tmp_path / "bench" / "results.json").exists()


def test_benchmark_refuses_bad_input_before_measuring(bundle, tmp_path):
    from mobile_moe.device_bench.bench import BenchSettings, benchmark
    from mobile_moe.errors import UsageError

    settings = BenchSettings(RoundSettings(iterations=1), runtime="onnxruntime", rounds=1)
    with pytest.raises(UsageError, match="is an executorch bundle; --runtime onnxruntime cannot run it"):
        benchmark([bundle], settings, tmp_path / "bench")
    with pytest.raises(UsageError, match="no bundle to benchmark"):
        benchmark([], BenchSettings(), tmp_path / "bench")
    with pytest.raises(TypeError, match="not one path"):
        benchmark(str(bundle), BenchSettings(), tmp_path / "bench")
    assert not (tmp_path / "bench").exists()
    with pytest.raises(UsageError, match="inside the bundle .*; choose a folder outside it"):
        benchmark([bundle], BenchSettings(), Path(bundle) / "inner" / "bench")  # its next export would refuse it
    assert not (Path(bundle) / "inner").exists()


def test_a_second_bench_into_one_out_is_refused_before_its_first_round(bundle, tmp_path, monkeypatch):
    """--out is claimed before the first round: a bench into an --out another is writing is refused when it starts,
    not after measuring."""
    import subprocess
    import sys

    from mobile_moe.device_bench import bench
    from mobile_moe.errors import UsageError

    monkeypatch.setattr(bench, "measure_round", lambda *args: pytest.fail("a round ran"))
    settings = bench.BenchSettings(RoundSettings(iterations=1, warmup=0, switch_repeats=0), rounds=1, images=2)
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    holder = rf"bench is being written by another mobile-moe command \(pid {first.pid}\b"
    try:
        (tmp_path / f".bench.tmp-{first.pid}-abcd1234").mkdir()  # the temporary a bench in progress holds
        with pytest.raises(UsageError, match=holder):
            bench.benchmark([bundle], settings, tmp_path / "bench", log=lambda message: None)
    finally:
        first.kill()
        first.wait()
    assert not (tmp_path / "bench").exists()
