"""Fault injection on the Python side: every manifest mutation and byte flip (tests/faults.py) through predict, the
Python runtime and bench; export's target directory (never delete what it did not write); SIGTERM and SIGKILL
during an export; predict on a FIFO; third-party noise on stderr. Bad input must give exit status 2 and one line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_model
from faults import (
    HEADER_BYTES,
    MANIFEST_MUTATIONS,
    REPORT_MANIFEST_MUTATIONS,
    WHOLE_MANIFEST_MUTATIONS,
    copy_bundle,
    first_weight_byte,
    flip_byte,
    flip_offsets,
    mutate_manifest,
    reseal,
    untrained_run,
    whole_bundle,
)
from PIL import Image

from mobile_moe.app.cli import main
from mobile_moe.errors import UsageError
from mobile_moe.export.manifest import read_manifest, verified_graph_files
from mobile_moe.export.runtime import load_bundle

pytestmark = pytest.mark.export
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def png(tmp_path) -> Path:
    path = tmp_path / "image.png"
    Image.fromarray((np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)).save(path)
    return path


def refused(argv: list[str], capsys) -> str:
    """Run the CLI in-process; assert exit status 2 and exactly one line on stderr; -> that line."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mobile-moe"), err
    return err


# --- the manifest mutation table ------------------------------------------------------------------------------------


PYTHON_MANIFEST_MUTATIONS = MANIFEST_MUTATIONS | REPORT_MANIFEST_MUTATIONS  # the native runner's: test_native_faults


@pytest.mark.parametrize("mutation", sorted(PYTHON_MANIFEST_MUTATIONS))
def test_mutated_manifest_is_refused_everywhere(mutation, bundle, png, tmp_path, capsys):
    broken = copy_bundle(bundle, tmp_path / "broken")
    mutate_manifest(broken, mutation, PYTHON_MANIFEST_MUTATIONS)
    refused(["predict", str(broken), str(png)], capsys)
    refused(["bench", str(broken), "--runtime", "executorch", "--out", str(tmp_path / "bench")], capsys)
    with pytest.raises(UsageError):
        load_bundle(broken)
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize("name", ["nine\nEVIL: 0 (p=1.000)", "\x1b[31mred", "tab\there"])
def test_a_class_name_with_a_control_character_is_refused_not_printed(name, bundle, png, tmp_path, capsys):
    """A newline or an escape code in a manifest's class name would forge a prediction line or a terminal colour where
    predict prints it: the manifest is refused by the one rule for class names. (The native runner never prints
    class names; it checks them as strings.)"""
    broken = copy_bundle(bundle, tmp_path / "broken")
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["class_names"][3] = name
    (broken / "manifest.json").write_text(json.dumps(manifest))
    assert "holds a control character" in refused(["predict", str(broken), str(png)], capsys)


# --- byte flips in graph files ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The whole bundle as ONNX: its manifest rules are the runtime's, whatever the backend (the native runner's own
    checks of the ExecuTorch one are in tests/device_bench/test_native_faults.py), and it exports in seconds."""
    return whole_bundle(tmp_path_factory, "onnx")


@pytest.mark.parametrize("mutation", sorted(WHOLE_MANIFEST_MUTATIONS))
def test_mutated_whole_manifest_is_refused_everywhere(mutation, whole, png, tmp_path, capsys):
    """The same for a whole bundle (a per-token MoE in one graph): its own layout rules, one line each."""
    broken = copy_bundle(whole, tmp_path / "broken")
    mutate_manifest(broken, mutation, WHOLE_MANIFEST_MUTATIONS)
    refused(["predict", str(broken), str(png)], capsys)
    refused(["bench", str(broken), "--out", str(tmp_path / "bench")], capsys)
    with pytest.raises(UsageError):
        load_bundle(broken)
    assert not (tmp_path / "bench").exists()


def test_whole_bundle_predicts_before_any_mutation(whole, png, capsys):
    capsys.readouterr()
    assert main(["predict", str(whole), str(png), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["experts"]


def exported_over(bundle: Path, tmp_path: Path) -> None:
    """What an export over `bundle` does to its readers: another valid bundle (every expert's weights changed, the
    manifest re-sealed) renamed over the folder as a whole, the old one moved aside (mobile_moe/utils/atomic.py)."""
    replacement = copy_bundle(bundle, tmp_path / "replacement")
    for weights in replacement.glob("expert_*.ptd"):
        flip_byte(weights, first_weight_byte(weights))
    reseal(replacement)
    os.replace(bundle, tmp_path / "aside")
    os.replace(replacement, bundle)


def test_an_expert_loaded_after_an_export_replaced_the_bundle_is_refused_as_replaced_not_as_damaged(
    onnx_bundle, tmp_path
):
    """export's Python runtime (ONNX here); libmobile_moe's refusal of the same is the next test's."""
    reader = copy_bundle(onnx_bundle, tmp_path / "bundle")
    runtime = load_bundle(reader)  # the router loads now, each expert when it is first chosen
    image = np.zeros(tuple(runtime.manifest.input.shape), dtype=np.float32)
    exported_over(reader, tmp_path)
    with pytest.raises(UsageError) as refusal:
        runtime.predict(image)
    assert str(refusal.value) == (
        f"{reader} was replaced (another command exported over it) while this command was reading it; run this "
        "command again"
    )
    assert load_bundle(reader).predict(image).experts  # the new bundle itself is sound


def test_an_executorch_bundle_exported_over_is_refused_by_the_library_in_its_words(bundle, tmp_path):
    reader = copy_bundle(bundle, tmp_path / "bundle")
    runtime = load_bundle(reader, park_experts=0)
    image = np.zeros(tuple(runtime.manifest.input.shape), dtype=np.float32)
    exported_over(reader, tmp_path)
    with pytest.raises(UsageError, match=r"changed since the bundle was opened .* write an update into a new folder"):
        runtime.predict(image)
    assert load_bundle(reader).predict(image).experts  # the new bundle itself is sound


def test_a_bundle_exported_over_between_a_graphs_check_and_its_load_is_refused_not_mixed(
    onnx_bundle, tmp_path, monkeypatch
):
    """The runtime checks a graph's files, then loads them by path: a swap in between would load the new bundle's
    graph against the old manifest (shapes that differ read as a corrupt bundle; equal ones as a silent mixture)."""
    from mobile_moe.export import runtime as runtime_module

    reader = copy_bundle(onnx_bundle, tmp_path / "bundle")
    runtime = load_bundle(reader)
    image = np.zeros(tuple(runtime.manifest.input.shape), dtype=np.float32)
    checked = runtime_module.verified_graph_files

    def checked_then_swapped(bundle_dir, graph):
        files = checked(bundle_dir, graph)
        exported_over(reader, tmp_path)
        return files

    monkeypatch.setattr(runtime_module, "verified_graph_files", checked_then_swapped)
    with pytest.raises(UsageError, match=r"was replaced \(another command exported over it\)"):
        runtime.predict(image)  # the chosen expert: checked in the old bundle, loaded from the new


@pytest.mark.slow  # two bench rounds and an export between them: 6.5 s on 2 cores
def test_a_bench_whose_bundle_is_exported_over_between_rounds_is_refused(bundle, tmp_path, capsys, monkeypatch):
    from mobile_moe.device_bench.python_worker import PythonWorker

    reader = copy_bundle(bundle, tmp_path / "bundle")
    real, rounds = PythonWorker.run_round, []

    def round_then_export(self, *args, **kwargs):
        rounds.append(real(self, *args, **kwargs))
        if len(rounds) == 1:
            exported_over(reader, tmp_path)
        return rounds[-1]

    monkeypatch.setattr(PythonWorker, "run_round", round_then_export)
    argv = ["bench", str(reader), "--runtime", "executorch", "--rounds", "2", "--iterations", "2", "--out"]
    assert "was replaced (another command exported over it)" in refused([*argv, str(tmp_path / "out")], capsys)
    assert len(rounds) == 1 and not (tmp_path / "out").exists()  # no results of two bundles under one name


def test_a_graph_file_that_does_not_match_says_so_once(bundle, png, tmp_path, capsys):
    broken = copy_bundle(bundle, tmp_path / "broken")
    flip_byte(broken / "router.pte", 1000)
    line = refused(["predict", str(broken), str(png)], capsys)
    assert line.count("re-export the bundle") == 1 and "is damaged" not in line, line


def test_flipped_byte_without_reseal_is_caught_by_sha256(bundle, png, tmp_path, capsys):
    router = copy_bundle(bundle, tmp_path / "router")
    flip_byte(router / "router.pte", 1000)
    assert "sha256" in refused(["predict", str(router), str(png)], capsys)
    expert = copy_bundle(bundle, tmp_path / "expert")
    weights = expert / "expert_2.ptd"  # expert 2's own weights (the experts share expert.pte)
    flip_byte(weights, first_weight_byte(weights))
    with pytest.raises(UsageError, match="expert_2.ptd does not match the sha256"):
        load_bundle(expert)  # libmobile_moe checks every file at open, as bench does before it runs any
    assert "sha256" in refused(["bench", str(expert), "--runtime", "executorch", "--out", str(tmp_path / "b")], capsys)


# predict on each bundle named, in one process: a line of JSON per bundle; after the first, a mark on the process's
# own stderr, so what native code and torch's logging wrote there during the first is told apart.
FIRST_DONE = "-- the first bundle's predict ended --\n"
PREDICT_WORKER = """
import contextlib, io, json, os, sys
from mobile_moe.app.cli import main
for index, bundle in enumerate(sys.argv[2:]):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        status = main(["predict", bundle, sys.argv[1], "--json"])
    print(json.dumps({"bundle": bundle, "status": status, "stderr": err.getvalue(), "stdout": out.getvalue()}))
    sys.stdout.flush()
    if index == 0:
        sys.stderr.flush()
        os.write(2, FIRST_DONE)
""".replace("FIRST_DONE", repr(FIRST_DONE.encode()))


def chosen_expert_weights(bundle: Path, png: Path, capsys) -> str:
    """The .ptd of the expert `png` is routed to: predict loads only that one."""
    capsys.readouterr()
    assert main(["predict", str(bundle), str(png), "--json"]) == 0
    return f"expert_{json.loads(capsys.readouterr().out)[0]['experts'][0]}.ptd"


# the slow set, every file (7-11 s a file on 2 cores): `make test` has five minutes on the slowest machine
@pytest.mark.slow
@pytest.mark.parametrize("graph", ["router.pte", "expert.pte", "the chosen expert's .ptd"])
def test_resealed_byte_flips_never_crash_predict(graph, bundle, png, tmp_path, capsys):
    """A flip the checksum cannot see (re-sealed), at every byte of the header and at seeded random places: the file
    checks (mobile_moe/export/flatbuffer_files.py), ExecuTorch's program verification and the shape checks refuse it
    with one line and exit 2, or the byte did not matter and the answer is the untouched bundle's. Never a signal (a
    flipped identifier byte used to abort the process: ExecuTorch logged it raw, and pybind11 could not decode it)."""
    if graph.startswith("the chosen"):
        graph = chosen_expert_weights(bundle, png, capsys)
    capsys.readouterr()
    assert main(["predict", str(bundle), str(png), "--json"]) == 0
    answer = capsys.readouterr().out
    size = (bundle / graph).stat().st_size
    copies = []
    offsets = sorted({*HEADER_BYTES, *flip_offsets(size, count=8, seed=1)})
    for offset in offsets:
        broken = copy_bundle(bundle, tmp_path / f"flip-{offset}")
        flip_byte(broken / graph, offset)
        reseal(broken)
        copies.append(str(broken))
    # One process for the untouched bundle and all copies (imports cost seconds); it prints a line per bundle, so a
    # crash names its flip.
    worker = [sys.executable, "-c", PREDICT_WORKER, str(png), str(bundle), *copies]
    result = subprocess.run(worker, capture_output=True, text=True, cwd=REPO, timeout=300)
    untouched, *rows = [json.loads(line) for line in result.stdout.splitlines()]
    crashed = copies[len(rows)] if len(rows) < len(copies) else None
    assert result.returncode == 0 and crashed is None, (crashed, result.returncode, result.stderr[-500:])
    # The untouched bundle, first in a fresh process, printed its answer and nothing else: no pytree warning, no
    # cpuinfo lines from ExecuTorch's native code.
    assert (untouched["status"], untouched["stdout"], untouched["stderr"]) == (0, answer, "")
    assert result.stderr.partition(FIRST_DONE)[0] == ""
    for row in rows:  # 2: refused (a bad bundle); 1: a graph ExecuTorch failed to run (the runtime's own line)
        assert row["status"] in (0, 1, 2), row
        assert row["stderr"].count("\n") == (1 if row["status"] else 0), row
    for offset, row in zip(offsets, rows, strict=True):
        # A header byte that passes did not matter: the answer is the untouched bundle's. (Elsewhere a flip may have
        # changed a weight, and with it the answer.)
        assert row["status"] == 2 or offset not in HEADER_BYTES or row["stdout"] == answer, (offset, row)
    assert sum(row["status"] == 2 for row in rows) > len(HEADER_BYTES) // 2  # most header bytes matter


@pytest.mark.slow
@pytest.mark.parametrize("graph", ["router.pte", "expert.pte", "expert_0.ptd"])
def test_resealed_header_flips_are_refused_by_bench_before_anything_runs(graph, bundle, tmp_path, capsys):
    """bench checks every graph file before it starts a runner: each header byte flipped and re-sealed that the file
    check (export.manifest.verified_graph_files) refuses is bench's one line, with the check's reason, and exit 2;
    every other flip benchmarks (a byte that does not matter) or is refused by ExecuTorch's own load, in one line.
    The flips include a refused one and one that benchmarks."""
    verdicts = set()
    for offset in HEADER_BYTES:
        broken = copy_bundle(bundle, tmp_path / f"flip-{offset}")
        flip_byte(broken / graph, offset)
        reseal(broken)
        entry = next(g for g in read_manifest(broken).graphs if graph in {file.file for file in g.files()})
        try:
            verified_graph_files(broken, entry)
            reason = None
        except UsageError as error:
            reason = str(error)
        argv = ["bench", str(broken), "--runtime", "executorch", "--iterations", "1", "--warmup", "0"]
        capsys.readouterr()
        status = main([*argv, "--rounds", "1", "--out", str(tmp_path / f"bench-{offset}")])
        err = capsys.readouterr().err
        if reason is None:
            refused = status == 2 and "is not a valid ExecuTorch program" in err  # ExecuTorch's own verification
            assert (status, err) == (0, "") or refused, (offset, err)
        else:
            assert status == 2 and reason in err, (offset, reason, err)
        assert err.count("\n") == status // 2, (offset, err)
        verdicts.add("runs" if status == 0 else "refused by the check" if reason else "refused by ExecuTorch")
    assert {"runs", "refused by the check"} <= verdicts


def test_damaged_executorch_files_are_refused_before_executorch_reads_them(bundle, tmp_path):
    """ExecuTorch does not verify a .ptd (a re-sealed flipped root offset made predict die by SIGSEGV on some runs)
    and logs a .pte's identifier raw (a flipped one aborted predict): the bundle's file verification refuses both,
    after their sha256 matched, every time."""
    broken = copy_bundle(bundle, tmp_path / "broken")
    flip_byte(broken / "expert_1.ptd", 0)
    flip_byte(broken / "router.pte", 4)
    reseal(broken)
    with pytest.raises(UsageError, match=r"router.pte is damaged: not an ExecuTorch program \(no ET12 identifier\)"):
        load_bundle(broken)  # the router loads at open
    manifest = read_manifest(broken)
    expert_1 = next(graph for graph in manifest.graphs if graph.expert == 1)
    with pytest.raises(UsageError, match=r"expert_1.ptd is damaged: FlatTensor.s vtable offset"):
        verified_graph_files(broken, expert_1)


# --- export: the target directory -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return untrained_run(tmp_path_factory.mktemp("run"), tiny_model("mobile-vmoe", num_classes=10, num_experts=2))


@pytest.fixture(scope="module")
def dense_run_dir(tmp_path_factory) -> Path:
    """For what a bundle's kind does not change: one graph exports in a second, a split MoE in three."""
    return untrained_run(tmp_path_factory.mktemp("dense-run"), tiny_model("vit", num_classes=10))


def test_export_never_deletes_a_web_apps_manifest_directory(run_dir, tmp_path, capsys):
    site = tmp_path / "site"
    site.mkdir()
    (site / "manifest.json").write_text('{"name": "my web app", "icons": []}')
    (site / "index.html").write_text("<html></html>")
    err = refused(["export", str(run_dir), "--format", "onnx", "--out", str(site)], capsys)
    assert "not a mobile-moe bundle" in err
    assert sorted(p.name for p in site.iterdir()) == ["index.html", "manifest.json"]


def test_export_replaces_its_own_bundle_but_not_files_added_to_it(dense_run_dir, tmp_path, capsys):
    out = tmp_path / "bundle"
    assert main(["export", str(dense_run_dir), "--format", "onnx", "--out", str(out)]) == 0
    assert main(["export", str(dense_run_dir), "--format", "onnx", "--out", str(out)]) == 0  # re-export: replaced
    (out / "notes.txt").write_text("mine")
    err = refused(["export", str(dense_run_dir), "--format", "onnx", "--out", str(out)], capsys)
    assert "notes.txt" in err and (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("out", ["/proc/mobile-moe/bundle", "/proc/version"])
def test_export_refuses_unwritable_out_before_work(run_dir, out, capsys, monkeypatch):
    import mobile_moe.export.source as source_module

    loaded = []
    monkeypatch.setattr(source_module, "source_from_run", lambda *args, **kwargs: loaded.append(args))
    refused(["export", str(run_dir), "--format", "onnx", "--out", out], capsys)
    assert loaded == []  # refused before the run is loaded, let alone exported


def _export_command(run_dir: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "mobile_moe", "export", str(run_dir), "--format", "onnx", "--out", str(out)]


def _wait_for_temporary(out: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not list(out.parent.glob(f".{out.name}.tmp-*")):
        assert process.poll() is None and time.monotonic() < deadline, "export ended before writing anything"
        time.sleep(0.05)
    time.sleep(0.3)  # inside the export, not at its first line


@pytest.mark.slow  # a CLI process of its own (torch's import); the fast set's SIGTERM is the traced-graph one below
def test_sigterm_during_export_leaves_nothing(run_dir, tmp_path):
    out = tmp_path / "bundle"
    process = subprocess.Popen(_export_command(run_dir, out), cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    _wait_for_temporary(out, process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert stderr.strip().splitlines() == ["mobile-moe: terminated"]
    assert list(tmp_path.iterdir()) == []


def test_sigterm_while_a_graph_is_traced_waits_for_its_end(run_dir, tmp_path, monkeypatch, capsys):
    """torch aborts the process when a stop unwinds it mid-trace (c10 TorchDispatchModeTLS::set_mode): a SIGTERM
    that arrives while torch.export runs the module is held until the graph's exporter returns, then the bundle's
    temporary directory is removed."""
    import mobile_moe.export.onnx_backend as onnx_backend

    real_export, real_exporter, finished = torch.export.export, onnx_backend.export_onnx, []

    def export_signalled_mid_trace(module, *args, **kwargs):
        signalled = []

        def signal_once(*_):
            if not signalled:
                signalled.append(signal.raise_signal(signal.SIGTERM))  # the handler runs in the traced forward

        hook = module.register_forward_pre_hook(signal_once)
        try:
            return real_export(module, *args, **kwargs)
        finally:
            hook.remove()

    def exporter_recording_its_end(*args, **kwargs):
        artifact = real_exporter(*args, **kwargs)
        finished.append(artifact.path.name)
        return artifact

    monkeypatch.setattr(torch.export, "export", export_signalled_mid_trace)
    monkeypatch.setattr(onnx_backend, "export_onnx", exporter_recording_its_end)
    assert main(["export", str(run_dir), "--format", "onnx", "--out", str(tmp_path / "bundle")]) == 143
    assert capsys.readouterr().err == "mobile-moe: terminated\n"
    assert finished == ["router.onnx"] and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_sigkilled_export_leftovers_are_removed_by_the_next_export(run_dir, tmp_path):
    out = tmp_path / "bundle"
    process = subprocess.Popen(_export_command(run_dir, out), cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    _wait_for_temporary(out, process)
    process.kill()
    process.wait()
    assert list(tmp_path.glob(".bundle.tmp-*"))  # SIGKILL runs no clean-up ...
    result = subprocess.run(_export_command(run_dir, out), cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # ... the next export of the same --out does


def test_atomic_write_removes_only_dead_processes_temporaries(tmp_path):
    """What a SIGKILLed writer leaves (.NAME.tmp-<pid>-*) goes at the next write of NAME; nothing else does."""
    from mobile_moe.utils.atomic import write_text_atomic

    dead = subprocess.Popen(["true"])  # only its pid matters: a process that has ended
    dead.wait()
    left = [tmp_path / f".out.json.tmp-{dead.pid}-x1", tmp_path / f".out.json.tmp-{dead.pid}-x2"]
    left[0].write_text("partial")
    left[1].mkdir()  # a directory export's temporary
    kept = [tmp_path / ".out.json.tmp-someone-elses", tmp_path / f".out.json.tmp-{os.getpid()}-mine",
            tmp_path / f".other.tmp-{dead.pid}-x"]  # fmt: skip
    for path in kept:
        path.write_text("not ours to delete")
    write_text_atomic(tmp_path / "out.json", "{}")
    assert not any(path.exists() for path in left) and all(path.exists() for path in kept)
    assert (tmp_path / "out.json").read_text() == "{}"


def test_directory_swap_interrupted_by_a_kill_restores_the_previous_version(tmp_path):
    """Killed between moving the old bundle aside and moving the new one in: the next write puts the old one back
    before it starts, so the target is never simply gone."""
    from mobile_moe.utils.atomic import atomic_path

    dead = subprocess.Popen(["true"])
    dead.wait()
    aside = tmp_path / f".bundle.tmp-{dead.pid}-old-abc"
    aside.mkdir()
    (aside / "manifest.json").write_text("previous")
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "bundle", directory=True):
        raise RuntimeError("this export fails")
    assert (tmp_path / "bundle" / "manifest.json").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


# --- predict and bench inputs ---------------------------------------------------------------------------------------


def test_predict_on_a_fifo_does_not_hang(bundle, tmp_path, capsys):
    fifo = tmp_path / "image.png"
    os.mkfifo(fifo)
    signal.alarm(30)  # a hang fails the test instead of the suite
    try:
        assert "not a regular file" in refused(["predict", str(bundle), str(fifo)], capsys)
    finally:
        signal.alarm(0)


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--data", "random:abc"], "seed"),
        (["--data", "digits"], "has 10 classes (0, 1, 2, ...) that are not the 7 of bundle"),  # bundle_model's
        (["--data", "digits"], "(0, 1, 2, ...): its class 8 is '7' where bundle"),  # the first class that differs
        (["--pause", "-1"], "--pause"),
        (["--switch-repeats", "-1"], "--switch-repeats"),
        (["--runner", "/nonexistent/runner"], "--runner"),
        (["--out", "/proc/mobile-moe"], "cannot write"),
        (["--cache-experts", "-2"], "--cache-experts -2: out of range (-1..4096)"),
        (["--park-experts", "5000"], "--park-experts 5000: out of range (-1..4096)"),
        (["--threads", "1025"], "--threads 1025: out of range (0..1024)"),
        (["--prefetch", "2"], "--prefetch 2: out of range (0..1)"),
    ],
)
def test_bench_refuses_bad_flags_before_measuring(flags, match, bundle, tmp_path, capsys):
    argv = ["bench", str(bundle), "--runtime", "executorch", "--out", str(tmp_path / "bench"), *flags]
    assert match in refused(argv, capsys)
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize("flags", [["--park-experts", "0"], ["--weight-cache-dir", ""], ["--prefetch", "0"]])
def test_bench_refuses_libmobile_moes_own_options_for_a_python_runtime(flags, onnx_bundle, tmp_path, capsys):
    argv = ["bench", str(onnx_bundle), "--runtime", "onnxruntime", "--out", str(tmp_path / "bench"), *flags]
    assert f"{flags[0]} is libmobile_moe's; --runtime onnxruntime has none" in refused(argv, capsys)


def test_paths_the_file_system_refuses_are_one_line(tmp_path, capsys):
    from mobile_moe.utils.atomic import check_writable

    with pytest.raises(UsageError, match="cannot write"):
        check_writable(tmp_path / ("a" * 300), directory=True)  # ENAMETOOLONG, raised by exists() itself


def test_a_symbolic_dimension_never_matches_the_manifest():
    from mobile_moe.export.loaded_graphs import check_shapes
    from mobile_moe.export.manifest_schema import GraphEntry, TensorSpec

    image = TensorSpec(name="images", shape=[1, 3, 32, 32], dtype="float32")
    graph = GraphEntry.model_construct(name="dense", file="dense.onnx", inputs=[image])
    with pytest.raises(UsageError, match="the bundle is corrupt"):
        check_shapes(graph, "inputs", [("batch", 3, 32, 32)])


def test_a_manifest_naming_a_file_in_a_subdirectory_does_not_make_the_directory_ours(tmp_path):
    from mobile_moe.export.manifest import FORMAT, bundle_files

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.pte").write_bytes(b"")
    graphs = [{"file": "data/x.pte"}, {"file": "r.pte"}]
    (tmp_path / "manifest.json").write_text(json.dumps({"format": FORMAT, "graphs": graphs}))
    (tmp_path / "r.pte").write_bytes(b"")
    assert bundle_files(tmp_path) == {"manifest.json", "r.pte"}


@pytest.mark.slow  # runs ExecuTorch or whole commands many times: in CI's slow set
def test_a_bundle_whose_name_is_not_utf8_predicts_and_benches(bundle, png, tmp_path):
    """Linux names are bytes: a folder name that is not UTF-8 reaches us as surrogate escapes; the native runtimes
    are handed a name they can open, tables and plots show it escaped, never a traceback."""
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/bundle-\xff"))
    shutil.copytree(bundle, odd)
    cli = [sys.executable, "-m", "mobile_moe"]
    predict = subprocess.run([*cli, "predict", str(odd), str(png)], cwd=REPO, capture_output=True, timeout=120)
    assert predict.returncode == 0 and predict.stderr == b"", predict.stderr
    out = tmp_path / "bench"
    argv = [*cli, "bench", str(odd), "--runtime", "executorch", "--warmup", "0", "--rounds", "1", "--images", "2",
            "--pause", "0", "--out", str(out)]  # fmt: skip
    bench = subprocess.run(argv, cwd=REPO, capture_output=True, timeout=300)
    assert bench.returncode == 0, bench.stderr
    assert "bundle-\\xff" in (out / "report.md").read_text()


@pytest.mark.slow  # an export, 4 s
def test_an_onnx_bundle_exports_into_a_folder_whose_name_is_not_utf8(tmp_path):
    """onnx's checker binds a path as UTF-8: export checks the proto it wrote, not the path, and writes the bundle."""
    from mobile_moe.export.bundle import export_bundle

    odd = Path(os.fsdecode(bytes(tmp_path) + b"/bundle-\xff"))
    export_bundle(tiny_model("vit").eval(), odd, "onnx")
    assert (odd / "manifest.json").is_file() and read_manifest(odd, verify_files=True).graphs
