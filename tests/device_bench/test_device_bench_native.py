"""The native runner against export's Python runtime, the adb flow (stand-in adb), and `mobile-moe bench` end to end.

One tiny ExecuTorch bundle and one runner build serve the whole module (session-scoped fixtures); build-dependent
tests skip, saying why, only when cmake or a C++ compiler is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import bundle_model, needs_build
from faults import outlives_its_killed_parent

from mobile_moe.app.cli import main
from mobile_moe.device_bench import routing_stats
from mobile_moe.device_bench.native_runner import parse_runner_output, run_native, runner_command
from mobile_moe.device_bench.python_worker import PythonWorker
from mobile_moe.device_bench.results import validate_results
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.device_bench.workload import random_workload, write_raw
from mobile_moe.errors import UsageError
from mobile_moe.export.manifest import read_manifest
from mobile_moe.export.manifest_schema import GraphEntry, Manifest
from mobile_moe.library.binding import default_weight_cache_dir as packed_weights_dir
from mobile_moe.library.build import SOURCE_DIR, build_runner

pytestmark = pytest.mark.export


@pytest.fixture(scope="session")
def workload_file(bundle, tmp_path_factory) -> Path:
    workload = random_workload(read_manifest(bundle, verify_files=True).input.shape, count=8, seed=3)
    return write_raw(workload, tmp_path_factory.mktemp("inputs") / "images.f32")


def python_predictions(bundle: Path, images_file: Path):
    from mobile_moe.export.runtime import load_bundle

    shape = read_manifest(bundle, verify_files=True).input.shape
    images = np.fromfile(images_file, dtype=np.float32).reshape(-1, *shape[1:])
    runtime = load_bundle(bundle)
    return [runtime.predict(image) for image in images]


@needs_build
def test_native_runner_reproduces_python_runtime(runner, bundle, workload_file):
    report = run_native(runner, bundle, workload_file, RoundSettings(iterations=3, warmup=1, cache_experts=1))
    expected = python_predictions(bundle, workload_file)
    assert [row["experts"] for row in report["images"]] == [p.experts for p in expected]
    native_logits = np.array([row["logits"] for row in report["images"]])
    python_logits = np.stack([p.logits for p in expected])
    np.testing.assert_allclose(native_logits, python_logits, atol=1e-4)
    np.testing.assert_allclose([row["gates"][0] for row in report["images"]], [p.gates[0] for p in expected], atol=1e-5)


@needs_build
@pytest.mark.parametrize("park_experts", [0, -1], ids=["unload", "park"])
def test_native_runner_loads_only_chosen_experts(runner, bundle, workload_file, park_experts):
    """With one expert resident, an evicted expert unloads (--park-experts 0) or parks (the default): a parked
    expert keeps its method and its files open, none of its packed weights' pages, and a switch back loads nothing."""
    manifest = read_manifest(bundle, verify_files=True)
    settings = RoundSettings(iterations=2, warmup=0, cache_experts=1, switch_repeats=0, park_experts=park_experts)
    # A load that packed cannot park (graph_loader.h locate_packed_weights): a first run warms the packed-weight cache
    # for every expert, whatever ran in this process's cache folder before.
    run_native(runner, bundle, workload_file, dataclasses.replace(settings, cache_experts=0))
    report = run_native(runner, bundle, workload_file, settings)
    sequence = [row["experts"] for row in report["images"]]
    chosen = {e for experts in sequence for e in experts}
    last = sequence[-1][0]
    assert len(chosen) >= 2, "precondition: the workload should route to several experts"
    # An expert's files: the program the experts share and its own weights file.
    files_of = {g.expert: {f.file for f in g.files()} for g in manifest.graphs if g.role == "expert"}
    assert all(len(files) == 2 for files in files_of.values())
    router_file = next(g.file for g in manifest.graphs if g.role == "router")
    # The OS's list of files the process held open agrees with the runner's own account of what it loaded.
    assert set(report["files_opened"]) == {router_file}.union(*(files_of[e] for e in chosen))
    assert report["graphs_loaded_after_routing"] == [f"expert_{last}"]  # LRU of one: the last expert
    held = chosen if park_experts == -1 else {last}  # a parked expert's files stay open, its pages do not
    assert set(report["files_open_after_routing"]) == {router_file}.union(*(files_of[e] for e in held))
    assert report["parked_experts"] == sorted(held - {last})
    assert report["parked_packed_bytes_resident"] == 0
    # Its cache hits are those an LRU of one would have on this sequence; a miss loaded one expert's files, or, for a
    # parked expert, nothing.
    hits = [row["cache_hit"] for row in report["images"]]
    assert sum(hits) / len(hits) == pytest.approx(routing_stats.lru_hit_rate(sequence, 1))
    misses = [row["experts"][0] for row in report["images"] if not row["cache_hit"]]
    loaded = set(misses) if park_experts == -1 else misses  # parking: each expert's first miss loads it
    sizes = {g.expert: g.load_bytes for g in manifest.graphs if g.role == "expert"}
    assert report["routing_pass_graph_bytes_loaded"] == sum(sizes[e] for e in loaded)
    assert report["graph_bytes"] == {g.name: g.load_bytes for g in manifest.graphs}  # program and weights file alike


@needs_build
def test_native_runner_percentiles_and_memory(runner, bundle, workload_file):
    report = run_native(runner, bundle, workload_file, RoundSettings(iterations=20, warmup=2))
    latency = report["latency_ms"]
    assert latency["min"] <= latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"]
    assert len(latency["samples"]) == 20
    assert report["memory_at_end"]["peak_rss_bytes"] >= report["memory_at_end"]["rss_bytes"] > 0
    assert report["switch"]["median_ms"] > 0 and len(report["switch"]["ms"]) == 2 * 4


@needs_build
@pytest.mark.parametrize("runtime", ["native", "executorch"])
def test_peak_memory_is_the_models_whatever_the_number_of_images(runner, bundle, tmp_path, runtime):
    """Runners read the workload one image at a time, as an app gets them: 3,000 images (36 MB) peak where 8 do,
    and answer the 8 they share exactly as a file of 8 (images read from their own offsets)."""
    shape = read_manifest(bundle, verify_files=True).input.shape
    many = write_raw(random_workload(shape, count=3000, seed=3), tmp_path / "many.f32")
    few = write_raw(random_workload(shape, count=8, seed=3), tmp_path / "few.f32")
    settings = RoundSettings(iterations=3, warmup=0, switch_repeats=0)
    run = (lambda images: run_native(runner, bundle, images, settings)) if runtime == "native" else (
        lambda images: PythonWorker(runtime).run_round(bundle, images, settings))  # fmt: skip
    reports = {name: run(images) for name, images in (("few", few), ("many", many))}
    peaks = {name: report["memory_after_warm"]["peak_rss_bytes"] for name, report in reports.items()}
    assert peaks["many"] - peaks["few"] < 8 << 20, peaks  # holding the file would add 36 MB (the native: 72)
    logits = {name: [row["logits"] for row in report["images"][:8]] for name, report in reports.items()}
    assert logits["many"] == logits["few"]


def planned_buffer_sizes(program_file: Path) -> list[int]:
    """The bytes each memory id of a program's forward method plans (ExecuTorch's own reading of the .pte)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(program_file.read_bytes()).program
    return list(program.execution_plan[0].non_const_buffer_sizes)


@needs_build
def test_every_graph_runs_in_one_planned_arena(runner, bundle, workload_file):
    """The router and every resident expert share one planned-memory arena per memory id, as large as the largest
    graph's: with all experts resident the runner allocates no more than with one, and both answer as the Python
    runtime does."""
    manifest = read_manifest(bundle, verify_files=True)
    plans = [planned_buffer_sizes(bundle / name) for name in sorted({g.file for g in manifest.graphs})]
    largest = sum(max(sizes) for sizes in zip(*plans, strict=True))  # the router's, in this bundle
    assert len(plans) == 2 and largest < sum(map(sum, plans))  # precondition: the expert's program plans memory too
    one, every = (
        run_native(runner, bundle, workload_file, RoundSettings(iterations=2, warmup=0, cache_experts=resident))
        for resident in (1, manifest.num_experts)
    )
    assert one["planned_memory_bytes"] == every["planned_memory_bytes"] == largest
    assert every["max_experts_resident"] > 1  # several experts held planned memory at once
    expected = np.stack([p.logits for p in python_predictions(bundle, workload_file)])
    for report in (one, every):  # a graph that wrote into another's live memory would change the answers
        np.testing.assert_allclose(np.array(logits_of(report)), expected, atol=1e-4)


@needs_build
def test_runner_refuses_bad_bundles(runner, bundle, workload_file, tmp_path):
    settings = RoundSettings(iterations=1, warmup=0)
    with pytest.raises(UsageError, match="no manifest"):
        run_native(runner, tmp_path, workload_file, settings)
    broken = tmp_path / "broken"
    shutil.copytree(bundle, broken)
    (broken / "expert_1.ptd").unlink()
    with pytest.raises(UsageError, match="expert_1.ptd"):
        run_native(runner, broken, workload_file, settings)
    with pytest.raises(UsageError, match="expert_1.ptd"):
        read_manifest(broken, verify_files=True)


@needs_build
def test_failed_build_shows_the_compiler_error(tmp_path):
    source = tmp_path / "native"
    shutil.copytree(SOURCE_DIR, source)
    (source / "runner" / "runner.cpp").write_text("int main() { return undeclared_name; }\n")
    with pytest.raises(UsageError, match=r"runner\.cpp.*undeclared_name"):
        build_runner(source, build_root=tmp_path / "cache")


@pytest.mark.parametrize(
    "failure, unavailable",
    [
        ("building the native runner failed at link: /usr/bin/ld: cannot find -lasan", True),
        ("building the native runner failed at link: cannot find libasan_preinit.o", True),
        ("building the native runner failed at compile: runner.cpp:578:6: error: unused function [-Werror]", False),
    ],
)
def test_only_a_missing_sanitizer_runtime_lets_its_tests_skip(tmp_path, monkeypatch, failure, unavailable):
    """The AddressSanitizer tests skip where the compiler has no libasan; a warning made an error in our own code had
    silently skipped all of them instead of failing."""
    from mobile_moe.library import build as native_build

    def fails(*args, **kwargs):
        raise UsageError(failure)

    monkeypatch.setattr(native_build, "_configure_and_compile", fails)
    monkeypatch.setattr(native_build, "missing_tools", lambda: [])
    with pytest.raises(UsageError) as refused:
        build_runner(build_root=tmp_path / "cache", sanitize="address")
    assert isinstance(refused.value, native_build.SanitizerUnavailable) == unavailable


@pytest.mark.parametrize(
    "damage", ["truncated", "a link to a text file", "not executable", "its digest lost", "a directory"]
)
def test_a_damaged_cached_runner_is_built_again_not_trusted_because_it_exists(tmp_path, monkeypatch, damage):
    """The runner cache holds what its build wrote: a runner cut short, replaced by a link, stripped of its mode or
    without its recorded digest is built again (a truncated one had crashed with SIGSEGV and been blamed on the
    bundle; a link to a text file had been reported as a --runner the user never passed). A directory in its place is
    one line that says so: not ours to delete."""
    import os

    from mobile_moe.library import build as native_build

    builds = []

    def compile_fake(source_dir, build_dir, **kwargs):  # what _configure_and_compile leaves: the runner, its digest
        builds.append(build_dir)
        work = build_dir / "cmake-build"
        work.mkdir(parents=True, exist_ok=True)
        (work / native_build.RUNNER_NAME).write_bytes(b"\x7fELF" + bytes(4096))
        (work / native_build.RUNNER_NAME).chmod(0o755)
        monkeypatch.setattr(native_build, "_run", lambda *a, **k: None)
        real_compile(source_dir, build_dir, **kwargs)

    real_compile = native_build._configure_and_compile
    monkeypatch.setattr(native_build, "_configure_and_compile", compile_fake)
    monkeypatch.setattr(native_build, "missing_tools", lambda: [])
    runner = build_runner(build_root=tmp_path / "cache")
    assert len(builds) == 1 and build_runner(build_root=tmp_path / "cache") == runner and len(builds) == 1
    if damage == "truncated":
        runner.write_bytes(runner.read_bytes()[:100])
    elif damage == "a link to a text file":
        (tmp_path / "notes.txt").write_text("not a program")
        runner.unlink()
        runner.symlink_to(tmp_path / "notes.txt")
    elif damage == "not executable":
        runner.chmod(0o644)
    elif damage == "a directory":
        runner.unlink()
        (runner / "somebody's").mkdir(parents=True)
        with pytest.raises(UsageError, match=rf"^{runner} is a directory where the built runner belongs; remove it"):
            build_runner(build_root=tmp_path / "cache")
        assert (runner / "somebody's").is_dir()  # not ours to delete
        return
    else:
        native_build.digest_file(runner).unlink()
    assert build_runner(build_root=tmp_path / "cache") == runner and len(builds) == 2
    assert not runner.is_symlink() and os.access(runner, os.X_OK) and native_build.built_intact(runner)
    assert (tmp_path / "notes.txt").read_text() == "not a program" if damage.startswith("a link") else True


FAKE_ADB = textwrap.dedent(
    '''
    """Stand-in adb: push/shell/pull against $FAKE_ADB_ROOT, the host-built runner standing in for the phone's."""
    import os, shutil, subprocess, sys

    ROOT = os.environ["FAKE_ADB_ROOT"]
    DEVICES = os.environ.get("FAKE_ADB_DEVICES", "FAKE0001").split()
    argv = sys.argv[1:]
    if argv[:1] == ["-s"]:
        if argv[1] not in DEVICES:
            sys.exit(f"adb: device '{argv[1]}' not found")
        argv = argv[2:]
    command, args = argv[0], argv[1:]
    local = lambda path: ROOT + path if path.startswith("/data/") else path
    if command == "devices":
        print("List of devices attached")
        print("".join(f"{serial}\\tdevice\\n" for serial in DEVICES), end="")
    elif command == "push":
        target = local(args[1])
        os.makedirs(os.path.dirname(target), exist_ok=True)
        (shutil.copytree if os.path.isdir(args[0]) else shutil.copy2)(args[0], target)
    elif command == "pull":
        if not os.path.exists(local(args[0])):
            sys.exit(f"adb: error: remote object '{args[0]}' does not exist")
        shutil.copy2(local(args[0]), args[1])
    elif command == "shell":
        done = subprocess.run(["sh", "-c", " ".join(args).replace("/data/", ROOT + "/data/")])
        sys.exit(done.returncode)
    else:
        sys.exit(f"adb: unknown command {command}")
    '''
)


@pytest.fixture
def fake_adb(tmp_path, monkeypatch) -> Path:
    bin_dir, phone = tmp_path / "bin", tmp_path / "phone"
    bin_dir.mkdir()
    (phone / "data/local/tmp").mkdir(parents=True)
    adb = bin_dir / "adb"
    adb.write_text(f"#!{sys.executable}\n{FAKE_ADB}")
    adb.chmod(adb.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_ADB_ROOT", str(phone))
    return phone


@needs_build
def test_android_flow_with_stand_in_adb(runner, bundle, workload_file, fake_adb):
    from mobile_moe.device_bench.android import run_on_android

    settings = RoundSettings(iterations=3, warmup=1, cache_experts=2)
    on_phone = run_on_android("FAKE0001", runner, bundle, workload_file, settings)
    on_host = run_native(runner, bundle, workload_file, settings)
    assert on_phone["bundle"].startswith(str(fake_adb / "data/local/tmp/mobile-moe-"))  # it ran from the phone's copy
    assert [row["experts"] for row in on_phone["images"]] == [row["experts"] for row in on_host["images"]]
    np.testing.assert_allclose(
        [row["logits"] for row in on_phone["images"]], [row["logits"] for row in on_host["images"]], atol=1e-6
    )
    # The run's folder is gone; the phone's packed-weight cache stays for the next run, as an app's cache folder does.
    assert [path.name for path in (fake_adb / "data/local/tmp").iterdir()] == ["mobile-moe-weight-cache"]
    cached = sorted(path.suffix for path in (fake_adb / "data/local/tmp/mobile-moe-weight-cache").iterdir())
    assert cached and set(cached) == {".xnnpack", ".check", ".txt"}  # .txt: verified-files.txt


@needs_build
def test_android_flow_errors(runner, bundle, workload_file, fake_adb, monkeypatch, tmp_path):
    from mobile_moe.device_bench.android import run_on_android

    settings = RoundSettings(iterations=1, warmup=0)
    with pytest.raises(UsageError, match="not attached"):
        run_on_android("OTHER", runner, bundle, workload_file, settings)
    monkeypatch.setenv("FAKE_ADB_DEVICES", "")
    with pytest.raises(UsageError, match="no Android device"):
        run_on_android(None, runner, bundle, workload_file, settings)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UsageError, match="adb on PATH"):
        run_on_android(None, runner, bundle, workload_file, settings)


@needs_build
def test_bench_cli_writes_results_and_report(runner, bundle, tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", str(bundle), "--runtime", "native", "--runner", str(runner), "--iterations", "5"]
    argv += ["--warmup", "1", "--rounds", "2", "--pause", "0", "--images", "6", "--out", str(out), "--json"]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert json.loads(capsys.readouterr().out) == results
    validate_results(results)
    run = results["runs"][0]
    assert run["rounds"] == 2 and len(run["spread"]["latency_p50_ms"]) == 2
    assert run["latency_ms"]["p50"] <= run["latency_ms"]["p90"] <= run["latency_ms"]["p99"]
    assert (
        set(run["cache_hit_rate"]) == {"1", "2", "3", "4"} and run["cache_hit_rate"]["4"] >= run["cache_hit_rate"]["1"]
    )
    assert run["params_active"] > 0 and run["bytes_loaded_per_image"] > 0
    for name in ("report.md", "latency.png", "memory.png"):
        assert (out / name).stat().st_size > 0
    assert "tiny-moe" in (out / "report.md").read_text()


@needs_build
def test_bench_cli_python_runtime(bundle, tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", str(bundle), "--runtime", "executorch", "--iterations", "3", "--warmup", "1", "--rounds", "1"]
    assert main([*argv, "--images", "4", "--out", str(out)]) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["runtime"] == "executorch" and run["latency_ms"]["p50"] > 0
    # A folder of other files is refused; so is an earlier bench's folder with a file of the user's beside ours (the
    # whole folder is replaced). Both before anything is measured.
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("not ours")
    assert main([*argv, "--out", str(tmp_path / "notes")]) == 2
    assert "notes exists and is not a mobile-moe bench's output" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["mine.txt"]
    (out / "my-notes.md").write_text("mine")
    assert main([*argv, "--images", "4", "--out", str(out)]) == 2
    said = capsys.readouterr().err
    assert "is a mobile-moe bench's output but also holds my-notes.md, which we did not write" in said
    assert (out / "my-notes.md").read_text() == "mine" and (out / "results.json").exists()


@needs_build
@pytest.mark.slow  # two benches (a worker process each, 5 s); the fast set's bench above keeps the refusals
def test_a_bench_into_an_earlier_benchs_folder_replaces_it(bundle, tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", str(bundle), "--runtime", "executorch", "--iterations", "3", "--warmup", "1", "--rounds", "1"]
    assert main([*argv, "--images", "4", "--out", str(out)]) == 0
    (out / "accuracy_vs_flops.png").write_bytes(b"an earlier bench's plot that this one does not draw")
    assert main([*argv, "--images", "4", "--out", str(out)]) == 0
    assert f"replacing the earlier bench in {out}" in capsys.readouterr().out
    assert not (out / "accuracy_vs_flops.png").exists()


def test_bench_cli_bad_input(bundle, tmp_path, capsys):
    assert main(["bench", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert main(["bench", str(bundle), "--iterations", "0"]) == 2
    assert "--iterations 0" in capsys.readouterr().err
    if sys.platform != "darwin":
        assert main(["bench", str(bundle), "--runtime", "coreml"]) == 2
        assert "macOS" in capsys.readouterr().err
    assert main(["bench", str(bundle), "--device", "android", "--runtime", "native"]) == 2
    assert "--runner" in capsys.readouterr().err


def _graph(name: str, role: str, expert, size: int, params: int) -> GraphEntry:
    return GraphEntry.model_construct(
        name=name, role=role, expert=expert, file=f"{name}.pte", sha256="0" * 64, bytes=size, params=params
    )


def test_bytes_and_params_loaded_per_image_are_honest_for_split_and_whole():
    """A split bundle loads its router and the experts each image picks; a whole per-token bundle loads its one graph,
    every expert inside, for every image, whichever experts the image's tokens used."""
    from mobile_moe.device_bench.report import comparisons
    from mobile_moe.device_bench.results import bytes_per_image, params_per_image

    split = Manifest.model_construct(
        graphs=[_graph("router", "router", None, 100, 10), _graph("expert_0", "expert", 0, 50, 5),
                _graph("expert_1", "expert", 1, 70, 7)],
        params_active_max=17,
    )  # fmt: skip
    whole = Manifest.model_construct(graphs=[_graph("whole", "whole", None, 300, 30)], params_active_max=20)
    assert bytes_per_image(split, [[0], [1], [1]]) == pytest.approx((150 + 170 + 170) / 3)
    assert params_per_image(split, [[0], [1]]) == pytest.approx(16)
    assert bytes_per_image(whole, [[0, 1, 2], [1]]) == 300 and params_per_image(whole, [[3]]) == 30

    def run(name: str, kind: str, manifest: Manifest, sequence: list[list[int]]) -> dict:
        return {
            "bundle_name": name, "kind": kind, "runtime": "native", "device": "host", "peak_rss_bytes": 1 << 20,
            "latency_ms": {"p50": 1.0}, "bytes_loaded_per_image": bytes_per_image(manifest, sequence),
            "params_loaded_per_image": params_per_image(manifest, sequence),
            "params_active": manifest.params_active_max,
        }  # fmt: skip

    (line,) = comparisons([run("mvmoe", "split", split, [[0]]), run("vmoe", "whole", whole, [[0, 1]])])
    assert line.startswith("- split mvmoe vs whole vmoe (native)") and "every expert" in line


def run_with_weight_cache(runner, bundle, images, cache_dir: Path, **settings) -> dict:
    """One runner process with --weight-cache-dir DIR."""
    command = runner_command(runner, bundle, images, RoundSettings(weight_cache_dir=str(cache_dir), **settings))
    result = subprocess.run(command, capture_output=True)
    return parse_runner_output(result.returncode, result.stdout, result.stderr, "native runner", bundle)


def first_loads(report: dict) -> dict[str, dict]:
    """Each graph's first load event in a runner report."""
    firsts: dict[str, dict] = {}
    for event in report["loads"]:
        firsts.setdefault(event["graph"], event)
    return firsts


def logits_of(report: dict) -> list[list[float]]:
    return [row["logits"] for row in report["images"]]


SWITCHING = {"iterations": 2, "warmup": 0, "cache_experts": 1, "switch_repeats": 1}


@needs_build
def test_a_second_load_of_an_expert_maps_its_packed_weights(runner, bundle, workload_file, tmp_path):
    """Experts sharing one program each get their own packed-weight cache file: the first load packs, every later
    load (in this process or the next) maps, and the answers are bit for bit those of a run without a cache. Evicted
    experts unload here (--park-experts 0), so every switch loads."""
    plain = run_native(runner, bundle, workload_file, RoundSettings(**SWITCHING, weight_cache_dir=""))
    cached = run_with_weight_cache(runner, bundle, workload_file, tmp_path, **SWITCHING, park_experts=0)
    assert logits_of(cached) == logits_of(plain)
    assert {(e["cache"], e["weights"]) for e in first_loads(cached).values()} == {("cold", "packed")}
    warm = [event for event in cached["loads"] if event["cache"] == "warm"]
    assert warm and all(event["weights"] == "mapped" for event in warm)
    assert (cached["switch"]["cache"], cached["switch"]["weights"], cached["switch"]["cold"]["weights"]) == (
        "warm",
        "mapped",
        "packed",
    )
    assert plain["switch"]["cache"] == "off" and plain["switch"]["cold"] is None
    # The next process finds every graph's file: nothing is packed again, the router included.
    again = run_with_weight_cache(runner, bundle, workload_file, tmp_path, **SWITCHING, park_experts=0)
    assert logits_of(again) == logits_of(plain)
    assert {(e["cache"], e["weights"]) for e in first_loads(again).values()} == {("warm", "mapped")}
    assert len(list(tmp_path.glob("*.xnnpack"))) == 1 + read_manifest(bundle).num_experts  # no scratch file left
    assert not list(tmp_path.glob("*.tmp-*"))  # the backend's staged files went once their copies were published


@needs_build
def test_a_parked_expert_answers_as_a_loaded_one_and_holds_none_of_its_packed_weights(
    runner, bundle, workload_file, tmp_path
):
    """By default an evicted expert parks: it keeps its method, its packed weights' pages leave the process, and a
    switch back loads nothing yet answers bit for bit as a load does. Without the packed-weight cache the weights live
    on the heap, so nothing parks."""
    loading = run_with_weight_cache(runner, bundle, workload_file, tmp_path, **SWITCHING, park_experts=0)
    parking = run_with_weight_cache(runner, bundle, workload_file, tmp_path, **SWITCHING)
    assert logits_of(parking) == logits_of(loading)
    assert parking["parked_experts"] and parking["parked_packed_bytes_resident"] == 0
    assert parking["switch"]["weights"] == "parked"  # every timed switch back loaded nothing
    assert loading["parked_experts"] == [] and loading["switch"]["weights"] == "mapped"
    bounded = run_with_weight_cache(runner, bundle, workload_file, tmp_path, **SWITCHING, park_experts=1)
    assert len(bounded["parked_experts"]) == 1 and logits_of(bounded) == logits_of(loading)
    # One resident, one parked: an image's expert loads unless it is the resident one or the one parked before it.
    resident, parked, loads = None, None, []
    for expert in (row["experts"][0] for row in bounded["images"]):
        if expert != resident:
            loads += [] if expert == parked else [expert]
            resident, parked = expert, resident
    sizes = {g.expert: g.load_bytes for g in read_manifest(bundle).graphs if g.role == "expert"}
    assert len(loads) < len(bounded["images"]) - sum(row["cache_hit"] for row in bounded["images"])  # precondition
    assert bounded["routing_pass_graph_bytes_loaded"] == sum(sizes[e] for e in loads)
    heap = run_native(runner, bundle, workload_file, RoundSettings(**SWITCHING, weight_cache_dir=""))
    assert heap["parked_experts"] == [] and heap["switch"]["weights"] == "packed"


def damage_cache_files(cache_dir: Path) -> None:
    """A different damage to each graph's cache file: flipped bytes in the packed data, the index and the footer,
    a truncated file, a file without its check file, and another graph's file and check file copied over."""
    files = sorted(cache_dir.glob("*.xnnpack"))
    assert len(files) >= 5, "precondition: the router and four experts have cache files"
    foreign = files[0].read_bytes(), files[0].with_suffix(".xnnpack.check").read_text()
    for path, at in zip(files[:3], (0.5, -40, -5), strict=True):
        data = bytearray(path.read_bytes())
        data[int(len(data) * at) if at > 0 else len(data) + int(at)] ^= 0xFF
        path.write_bytes(bytes(data))
    files[3].write_bytes(files[3].read_bytes()[: files[3].stat().st_size // 2])
    files[4].write_bytes(foreign[0])
    files[4].with_suffix(".xnnpack.check").write_text(foreign[1])
    if len(files) > 5:
        files[5].with_suffix(".xnnpack.check").unlink()


@needs_build
def test_a_damaged_packed_weight_cache_is_rebuilt_and_the_answer_stays_right(runner, bundle, workload_file, tmp_path):
    """XNNPACK maps a cache file's packed bytes without checking them: the runner's check file catches every damage
    before the backend sees it, the load packs afresh, and the logits still equal the cache-free run's and eager
    PyTorch's."""
    plain = run_native(runner, bundle, workload_file, RoundSettings(**SWITCHING))
    run_with_weight_cache(runner, bundle, workload_file, tmp_path, **SWITCHING)
    damage_cache_files(tmp_path)
    rebuilt = run_with_weight_cache(runner, bundle, workload_file, tmp_path, **SWITCHING)
    assert logits_of(rebuilt) == logits_of(plain)
    shape = read_manifest(bundle).input.shape
    images = torch.from_numpy(np.fromfile(workload_file, dtype=np.float32).reshape(-1, *shape[1:]))
    with torch.no_grad():
        eager = bundle_model()(images).logits.numpy()
    np.testing.assert_allclose(logits_of(rebuilt), eager, atol=1e-4)
    assert {(e["cache"], e["weights"]) for e in first_loads(rebuilt).values()} == {("cold", "packed")}
    healed = run_with_weight_cache(runner, bundle, workload_file, tmp_path, **SWITCHING)
    assert {(e["cache"], e["weights"]) for e in first_loads(healed).values()} == {("warm", "mapped")}


@needs_build
def test_runner_without_switch_samples_reports_null_medians(runner, bundle, workload_file):
    """Nothing timed is null in the JSON (never a made-up number), and the aggregate says so."""
    from mobile_moe.device_bench.results import summarize_round, validate_round

    report = run_native(runner, bundle, workload_file, RoundSettings(iterations=1, warmup=0, switch_repeats=0))
    switch = report["switch"]
    assert switch["ms"] == [] and switch["median_ms"] is None and switch["weights"] is None
    assert set(switch["parts_median_ms"].values()) == {None}
    summary = summarize_round(validate_round(report, "native runner"))
    assert summary["switch_ms"] is None and summary["switch_load_ms"] is None


@needs_build
@pytest.mark.parametrize("make, match", [(lambda p: p / "file" / "sub", "cannot create it"),
                                         (lambda p: p / "file", "not a directory"),
                                         (lambda p: p / ("d" * 250), "too long")])  # fmt: skip
def test_runner_refuses_a_weight_cache_it_cannot_use(runner, bundle, tmp_path, make, match):
    (tmp_path / "file").write_text("")
    (tmp_path / ("d" * 250)).mkdir()
    with pytest.raises(UsageError, match=match):
        run_with_weight_cache(runner, bundle, None, make(tmp_path), iterations=1, warmup=0)


@needs_build
def test_a_missing_weight_cache_folder_is_created(runner, bundle, tmp_path):
    """As an app's cache folder (mm_options.weight_cache_dir): made, parents and all, then used."""
    folder = tmp_path / "not" / "yet"
    run_with_weight_cache(runner, bundle, None, folder, iterations=1, warmup=0)
    assert folder.is_dir() and any(folder.glob("*.xnnpack"))


@needs_build
def test_the_runners_own_defaults_are_the_round_settings(runner, bundle):
    """A bundle is run by hand on a phone with the runner's own defaults: they are bench's (RoundSettings)."""
    result = subprocess.run([str(runner), "--bundle", str(bundle), "--random", "1"], capture_output=True, check=True)
    report, defaults = json.loads(result.stdout), RoundSettings()
    assert (report["iterations"], report["warmup"], report["threads"]) == (
        defaults.iterations,
        defaults.warmup,
        defaults.threads,
    )
    assert report["weight_cache"] and defaults.weight_cache_dir is None  # the library's per-user folder
    assert report["weight_cache_dir"] == str(packed_weights_dir())  # one folder, whoever starts the runner
    assert report["cache_margin"] == defaults.cache_margin
    assert report["cache_experts"] == report["top_k"] and defaults.cache_experts == -1  # the bundle's top_k
    assert report["park_experts"] == -1 == defaults.park_experts  # every evicted expert parks
    assert len(report["switch"]["ms"]) == report["num_experts"] * defaults.switch_repeats


def test_an_images_count_beyond_the_machines_memory_is_one_line_before_any_work(bundle, tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", str(bundle), "--runtime", "executorch", "--images", "100000000", "--out", str(out)]
    assert main(argv) == 2  # 100 million 3x32x32 images: 1.1 TiB of float32, never asked of numpy
    err = capsys.readouterr().err.strip()
    assert "--images 100000000" in err and "give at most" in err and len(err.splitlines()) == 1
    assert not out.exists()


@needs_build  # without the tools the refusal names them instead
def test_a_cache_folder_that_cannot_be_written_is_one_line():
    with pytest.raises(UsageError, match="cannot build the native runner in /proc/mobile-moe-cache") as refused:
        build_runner(build_root=Path("/proc/mobile-moe-cache"))  # not writable, even for root
    assert "MOBILE_MOE_CACHE" in str(refused.value) and "\n" not in str(refused.value)


@needs_build
@pytest.mark.parametrize(
    "env",
    [
        {"MOBILE_MOE_WEIGHT_CACHE": "weights"},
        {"MOBILE_MOE_CACHE": "ours", "XDG_CACHE_HOME": "xdg"},
        {"XDG_CACHE_HOME": "xdg"},
        {"HOME": "home"},
        {"XDG_CACHE_HOME": "./relative", "HOME": "home"},  # a relative XDG_CACHE_HOME is ignored (the XDG spec)
    ],
)
def test_the_runner_started_by_hand_finds_the_users_packed_weights_where_python_puts_them(
    runner, bundle, tmp_path, monkeypatch, env
):
    """The per-user folder (packed_cache.h default_cache_dir) is the one the toolkit asks the library for, created on
    first use, whichever variables say where it is."""
    for name in ("MOBILE_MOE_WEIGHT_CACHE", "MOBILE_MOE_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # where a relative path would land
    for name, value in env.items():
        monkeypatch.setenv(name, value if value.startswith("./") else str(tmp_path / value))
    result = subprocess.run([str(runner), "--bundle", str(bundle), "--random", "1", "--iterations", "1"],
                            capture_output=True, check=True)  # fmt: skip
    report = json.loads(result.stdout)
    assert report["weight_cache"] and report["weight_cache_dir"] == str(packed_weights_dir())
    assert list(packed_weights_dir().glob("*.xnnpack")) and report["weight_cache_bytes"] > 0
    assert packed_weights_dir().is_absolute() and not (tmp_path / "relative").exists()


@needs_build
def test_two_runners_filling_one_cache_at_once_both_answer_right_and_leave_it_whole(
    runner, bundle, workload_file, tmp_path
):
    """Two processes' first uses of an empty cache folder at the same time: each publishes what it packed by rename,
    neither reads a file the other is writing, both answers are the uncached one, and a third run maps every graph."""
    plain = run_native(runner, bundle, workload_file, RoundSettings(**SWITCHING, weight_cache_dir=""))
    settings = RoundSettings(**SWITCHING, weight_cache_dir=str(tmp_path))
    command = runner_command(runner, bundle, workload_file, settings)
    both = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    for process in both:
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr.decode(errors="replace")
        assert logits_of(json.loads(stdout)) == logits_of(plain)
    assert not list(tmp_path.glob("*.tmp-*"))  # every staged file was published
    third = run_with_weight_cache(runner, bundle, workload_file, tmp_path, **SWITCHING)
    assert {(e["cache"], e["weights"]) for e in first_loads(third).values()} == {("warm", "mapped")}
    assert logits_of(third) == logits_of(plain)


@needs_build
def test_the_cache_folder_keeps_within_its_limit_by_dropping_the_least_recently_used(runner, bundle, tmp_path):
    """Two older graphs' files (600 KiB each, last used long ago) and the bundle's own (about 0.7 MiB) under a 1 MiB
    limit: the least recently used go, the files just written stay, the answer is the uncached one, and a killed
    run's staged file and its copy go too."""
    old = [tmp_path / f"{digit * 32}.xnnpack" for digit in "ab"]
    for path in old:
        path.write_bytes(bytes(600 << 10))
        (tmp_path / f"{path.name}.check").write_text("an older graph's check\n")
        os.utime(tmp_path / f"{path.name}.check", (1000, 1000))
    host = socket.gethostname().split(".")[0]
    (tmp_path / f"{'0' * 32}.xnnpack.tmp-999999999@{host}").write_bytes(b"a killed run's leftover")
    (tmp_path / f"{'0' * 32}.xnnpack.tmp-999999999@{host}.copy").write_bytes(b"and the copy it was publishing")
    (tmp_path / f"{'2' * 32}.xnnpack.tmp-999999999-0000000a@{host}").write_bytes(b"a killed handle's, numbered")
    (tmp_path / f"{'1' * 32}.xnnpack.tmp-999999999@another-host").write_bytes(b"a live run's, on another machine")
    command = [str(runner), "--bundle", str(bundle), "--random", "2", "--iterations", "1", "--warmup", "0",
               "--weight-cache-dir", str(tmp_path), "--weight-cache-limit-mib", "1"]  # fmt: skip
    report = json.loads(subprocess.run(command, capture_output=True, check=True).stdout)
    uncached = [*command[:-4], "--weight-cache-dir", ""]
    uncached = json.loads(subprocess.run(uncached, capture_output=True, check=True).stdout)
    files = list(tmp_path.glob("*.xnnpack"))
    assert not any(path.exists() for path in old) and files
    assert sum(path.stat().st_size for path in files) == report["weight_cache_bytes"] <= 1 << 20
    assert all((tmp_path / f"{path.name}.check").is_file() for path in files)
    assert [path.name for path in tmp_path.glob("*.tmp-*")] == [f"{'1' * 32}.xnnpack.tmp-999999999@another-host"]
    assert logits_of(report) == logits_of(uncached)


@needs_build
@pytest.mark.parametrize("mode", ["none", "model", "global"])
def test_every_workspace_sharing_mode_answers_as_the_backends_default(runner, bundle, workload_file, mode):
    """XNNPACK's workspace sharing (one workspace per method, per program, or for every method) changes where
    intermediate values live, never what they are."""
    default = run_native(runner, bundle, workload_file, RoundSettings(**SWITCHING))
    command = runner_command(runner, bundle, workload_file, RoundSettings(**SWITCHING)) + ["--workspace-sharing", mode]
    report = json.loads(subprocess.run(command, capture_output=True, check=True).stdout)
    assert report["workspace_sharing"] == ["none", "model", "global"].index(mode)
    assert logits_of(report) == logits_of(default)


@needs_build
def test_an_unknown_workspace_sharing_mode_is_one_line(runner, bundle):
    result = subprocess.run([str(runner), "--bundle", str(bundle), "--workspace-sharing", "all"], capture_output=True)
    assert result.returncode == 2 and b"--workspace-sharing is none, model or global" in result.stderr


@needs_build
def test_a_cache_folder_that_cannot_be_made_means_no_cache_not_an_error(runner, bundle, tmp_path, monkeypatch):
    """A cache location under a file (as a read-only home would be): bench and the runner by hand pack on the heap
    and say so in their report, rather than failing."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MOBILE_MOE_WEIGHT_CACHE", str(tmp_path / "a-file" / "packed-weights"))
    assert packed_weights_dir() is None
    report = run_native(runner, bundle, None, RoundSettings(iterations=1, warmup=0))
    assert report["weight_cache"] is False and report["weight_cache_bytes"] == 0
    by_hand = subprocess.run([str(runner), "--bundle", str(bundle), "--random", "1", "--iterations", "1"],
                             capture_output=True, check=True)  # fmt: skip
    assert json.loads(by_hand.stdout)["weight_cache"] is False


def test_the_cache_root_is_never_relative(monkeypatch):
    """HOME empty, unset or relative, and XDG_CACHE_HOME relative: the home directory comes from the password
    database, as the runner takes it too."""
    import pwd

    from mobile_moe.utils.cache import cache_root

    for name in ("MOBILE_MOE_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    expected = pwd.getpwuid(os.getuid()).pw_dir
    monkeypatch.setenv("HOME", "")
    assert cache_root() == Path(expected) / ".cache" / "mobile-moe"
    monkeypatch.delenv("HOME")
    assert cache_root() == Path(expected) / ".cache" / "mobile-moe"
    monkeypatch.setenv("HOME", "relative/home")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache_root() == Path(expected) / ".cache" / "mobile-moe"


@needs_build
def test_the_runner_dies_with_the_bench_that_started_it_even_when_the_bench_is_sigkilled(runner, bundle):
    """The runner asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG): a SIGKILLed bench cannot stop
    it, and it would otherwise run a long round to the end for nobody."""
    command = [str(runner), "--bundle", str(bundle), "--random", "2", "--iterations", "10000000", "--warmup", "0",
               "--weight-cache-dir", ""]  # fmt: skip
    assert not outlives_its_killed_parent(command)


@pytest.mark.slow  # two runs of export's runtime, 11 s on 2 cores; the fast set checks results.host_parity
def test_an_emulated_runs_parity_is_taken_against_exports_runtime_on_the_same_images(bundle, tmp_path):
    """bench's parity_with_host, with a round of export's own runtime standing in for the emulated one (the slow
    arm64 test runs the real one under qemu): the same images and cache settings, every image matched."""
    from mobile_moe.device_bench.bench import BenchSettings, parity_with_host
    from mobile_moe.device_bench.results import validate_round
    from mobile_moe.device_bench.round_settings import RoundSettings
    from mobile_moe.device_bench.workload import random_workload, write_raw

    images = write_raw(random_workload([1, 3, 32, 32], count=5, seed=2), tmp_path / "images.f32")
    settings = BenchSettings(RoundSettings(iterations=2, warmup=0, cache_experts=1, switch_repeats=0), rounds=1)
    stand_in = validate_round(PythonWorker("executorch").run_round(bundle, images, settings.round), "stand-in")
    parity = parity_with_host(str(bundle), stand_in, images, settings)
    assert parity == {"reference": "executorch (Python, this host)", "images": 5, "max_abs_logit_diff": 0.0,
                      "same_class": 5, "same_experts": 5}  # fmt: skip
