"""The Python bench worker (ExecuTorch Python bindings, ONNX Runtime): its report has every stage, the switch
timing honours --switch-repeats, and --threads reaches every session it opens."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from device_bench import python_worker
from device_bench.workload import random_workload, write_raw
from export.manifest import read_manifest
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def onnx_bundle(tmp_path_factory) -> Path:
    from export.bundle import export_bundle

    out = tmp_path_factory.mktemp("bundles") / "tiny-moe-onnx"
    export_bundle(tiny_model("mobile-vmoe", pool="mean").eval(), out, "onnx")
    return out


@pytest.fixture(params=["executorch", "onnxruntime"])
def split_bundle(request, bundle, onnx_bundle) -> tuple[Path, str]:
    return (bundle if request.param == "executorch" else onnx_bundle), request.param


def worker_args(bundle: Path, runtime: str, tmp_path: Path, **changes) -> argparse.Namespace:
    images = write_raw(random_workload(read_manifest(bundle)["input"]["shape"], count=8, seed=3), tmp_path / "x.f32")
    fields = {"bundle": str(bundle), "runtime": runtime, "input": str(images), "iterations": 6, "warmup": 1,
              "threads": 1, "cache_experts": None, "switch_repeats": 2, **changes}  # fmt: skip
    return argparse.Namespace(**fields)


def test_report_times_the_router_and_the_expert_stage(split_bundle, tmp_path):
    bundle, runtime = split_bundle
    report = python_worker.measure(worker_args(bundle, runtime, tmp_path))
    stages = report["stages_ms"]
    assert stages["router"]["p50"] > 0 and stages["expert"]["p50"] > 0  # the expert stage was always 0
    assert stages["router"]["p50"] + stages["expert"]["p50"] <= report["latency_ms"]["p50"] * 1.5
    assert all(row["router_ms"] > 0 for row in report["images"])


@pytest.mark.parametrize("repeats", [0, 1, 3])
def test_switch_timing_follows_switch_repeats(bundle, tmp_path, repeats):
    report = python_worker.measure(worker_args(bundle, "executorch", tmp_path, switch_repeats=repeats))
    switch = report["switch"]
    experts_used = {row["experts"][0] for row in report["images"]}
    assert len(experts_used) >= 2  # mean pooling: random images reach different experts
    if repeats == 0:
        assert switch["ms"] == [] and "switch timing off" in switch["note"]
    else:
        assert len(switch["ms"]) == repeats * len(experts_used)  # one cold switch per expert per repeat


def test_threads_reach_every_onnxruntime_session(onnx_bundle, tmp_path, monkeypatch):
    """Without it each session made its own thread pool: eleven graphs fought over the cores (issue 12)."""
    from export import runners

    threads_of_sessions = []

    def opened(path, graph, threads=None):
        runner = runners.OnnxRunner(path, graph, threads)
        threads_of_sessions.append(runner.session.get_session_options().intra_op_num_threads)
        return runner

    monkeypatch.setitem(runners.RUNNERS, "onnx", opened)
    python_worker.measure(worker_args(onnx_bundle, "onnxruntime", tmp_path, threads=2))
    assert len(threads_of_sessions) >= 3  # the router and at least two experts, for the timing and the switch
    assert set(threads_of_sessions) == {2}
