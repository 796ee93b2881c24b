"""Early routing: a Mobile V-MoE's router reads the tokens after dense block J (`router_block`), export cuts the trunk
there (router, trunk tail, experts), and the native runner loads the chosen expert while the tail runs."""

from __future__ import annotations

import hashlib
import subprocess

import numpy as np
import pytest
import torch
from conftest import needs_build, tiny_model

from mobile_moe.device_bench.native_runner import parse_runner_output, runner_command
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.errors import UsageError
from mobile_moe.export.bundle import export_bundle
from mobile_moe.export.manifest import read_manifest
from mobile_moe.export.runtime import load_bundle
from mobile_moe.models.registry import create_model

pytestmark = pytest.mark.export

EARLY = {"depth": 4, "moe_layers": 2, "router_block": 1, "pool": "mean"}  # 2 dense blocks, the router after the first


def images(count: int = 8) -> torch.Tensor:
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(3)) * 2


def test_the_papers_placement_is_the_default_bit_for_bit():
    """router_block = the number of dense blocks is where the router reads by default (None): the same model, the
    same logits."""
    default = tiny_model("mobile-vmoe").eval()
    explicit = tiny_model("mobile-vmoe", router_block=default.config.dense_layers).eval()
    with torch.no_grad():
        assert torch.equal(default(images()).logits, explicit(images()).logits)
    assert default.config.to_dict()["router_block"] is None
    assert not explicit.config.early_routing


def test_the_router_reads_the_tokens_after_block_j():
    model = tiny_model("mobile-vmoe", **EARLY).eval()
    stage = model.router_stage
    with torch.no_grad():
        after_block_1 = stage.blocks[0](stage.embedding(images()))
        expected = stage.router(after_block_1).probs
        assert torch.equal(model(images()).routing.probs, expected)
        # The trunk still runs every dense block before the MoE blocks.
        tokens, _ = stage(images())
        assert torch.equal(tokens, stage.blocks[1](after_block_1))


@pytest.mark.parametrize("router_block", [0, 3, 1.5])
def test_a_router_block_outside_the_dense_blocks_is_refused(router_block):
    with pytest.raises(UsageError, match="router_block"):
        create_model("mobile-vmoe", **{**EARLY, "router_block": router_block, "image_size": 32, "patch_size": 8})


def test_early_routing_exports_as_expert_paths_only(tmp_path):
    with pytest.raises(UsageError, match="expert-paths only"):
        export_bundle(tiny_model("mobile-vmoe", **EARLY).eval(), tmp_path / "b", "executorch", layout="per-block")
    assert not (tmp_path / "b").exists()


def _graph_digests(bundle) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in bundle.iterdir() if p.suffix != ".json"}


@pytest.mark.slow  # an export (10 s); the default model's parity is also held by every export test
def test_a_default_model_exports_the_bundle_it_always_did(bundle, tmp_path):
    """No trunk tail, and the same graph files as the paper's placement named explicitly (`bundle`: conftest's tiny
    Mobile V-MoE, the same model without router_block)."""
    default = read_manifest(bundle)
    dense_layers = tiny_model("mobile-vmoe").config.dense_layers
    explicit = tiny_model("mobile-vmoe", pool="mean", router_block=dense_layers).eval()
    export_bundle(explicit, tmp_path / "explicit", "executorch")
    assert default.composition.trunk_tail is None and default.model.model_dump()["router_block"] is None
    assert {graph.role for graph in default.graphs} == {"router", "expert"}
    assert _graph_digests(bundle) == _graph_digests(tmp_path / "explicit")


# The early-routing bundle's tests are in the slow set: its ExecuTorch export takes 12 s on 2 cores.
@pytest.fixture(scope="module")
def early_bundle(tmp_path_factory):
    model = tiny_model("mobile-vmoe", **EARLY).eval()
    out = tmp_path_factory.mktemp("early") / "bundle"
    return model, export_bundle(model, out, "executorch"), out


@pytest.mark.slow
def test_an_early_routing_bundle_computes_the_model(early_bundle):
    model, manifest, path = early_bundle
    assert manifest.composition.trunk_tail == "trunk_tail"
    assert [graph.role for graph in manifest.graphs][:2] == ["router", "trunk_tail"]
    with torch.no_grad():
        eager = model(images())
    runtime = load_bundle(path, cache_experts=1)
    predictions = [runtime.predict(image) for image in images()]
    assert [p.experts[0] for p in predictions] == eager.routing.experts[:, 0].tolist()
    np.testing.assert_allclose(np.stack([p.logits for p in predictions]), eager.logits.numpy(), atol=1e-5)


def run_prefetching(runner, path, tmp_path, *flags: str) -> dict:
    """One runner process with one expert resident; evicted experts unload (--park-experts 0), so every miss loads."""
    raw = tmp_path / "images.f32"
    images().numpy().astype(np.float32).tofile(raw)
    settings = RoundSettings(iterations=3, warmup=0, cache_experts=1, switch_repeats=1, park_experts=0)
    result = subprocess.run([*runner_command(runner, path, raw, settings), *flags], capture_output=True, timeout=300)
    return parse_runner_output(result.returncode, result.stdout, result.stderr, "native runner", path)


@needs_build
@pytest.mark.slow
def test_the_native_runner_loads_the_expert_while_the_tail_runs(runner, early_bundle, tmp_path):
    """The runner's answers are the Python runtime's; every miss is loaded on the second thread (its load timed
    there) while the tail ran, and only the graphs an image needs were opened. --prefetch 0 loads in line, with the
    same answers."""
    _, _, path = early_bundle
    report = run_prefetching(runner, path, tmp_path)
    runtime = load_bundle(path, cache_experts=1)
    expected = [runtime.predict(image) for image in images()]
    assert [row["experts"] for row in report["images"]] == [p.experts for p in expected]
    np.testing.assert_allclose([row["logits"] for row in report["images"]], [p.logits for p in expected], atol=1e-5)
    misses = [row for row in report["images"] if not row["cache_hit"]]
    assert report["prefetch"] and report["max_experts_resident"] == 1
    assert len(misses) >= 2 and all(row["load_ms"] > 0 and row["load_wait_ms"] >= 0 for row in misses)
    chosen = {e for row in report["images"] for e in row["experts"]}
    needed = [graph for graph in read_manifest(path).graphs if not graph.loads_per_expert or graph.expert in chosen]
    assert set(report["files_opened"]) == {file.file for graph in needed for file in graph.files()}
    assert report["graph_bytes"] == {graph.name: graph.load_bytes for graph in read_manifest(path).graphs}
    assert all(row["tail_ms"] > 0 for row in misses) and "trunk_tail" in report["stages_ms"]
    in_line = run_prefetching(runner, path, tmp_path, "--prefetch", "0")
    assert not in_line["prefetch"] and all(row["load_wait_ms"] == 0 for row in in_line["images"])
    assert [row["logits"] for row in in_line["images"]] == [row["logits"] for row in report["images"]]


@needs_build
@pytest.mark.slow
def test_the_prefetch_thread_runs_clean_under_thread_sanitizer(early_bundle, tmp_path):
    """The second thread that loads the chosen expert while the tail runs, in a ThreadSanitizer build of the runner
    (its own code instrumented): no data race reported, the same answers as the plain build's Python twin."""
    from mobile_moe.library.build import ASAN_EXIT_CODE, SanitizerUnavailable, build_runner, sanitizer_env

    try:
        tsan = build_runner(sanitize="thread")
    except SanitizerUnavailable as error:  # no libtsan for this compiler; a compile error in our code still fails
        pytest.skip(f"cannot build the ThreadSanitizer runner here: {error}")
    _, _, path = early_bundle
    raw = tmp_path / "images.f32"
    images().numpy().astype(np.float32).tofile(raw)
    settings = RoundSettings(iterations=3, warmup=0, cache_experts=1, switch_repeats=1,
                             weight_cache_dir=str(tmp_path / "weight-cache"))  # fmt: skip
    command = runner_command(tsan, path, raw, settings)
    result = subprocess.run(command, capture_output=True, env=sanitizer_env(), timeout=300, check=False)
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode != ASAN_EXIT_CODE and "ThreadSanitizer" not in stderr, stderr[-3000:]
    report = parse_runner_output(result.returncode, result.stdout, result.stderr, "tsan runner", path)
    expected = [p.experts for p in (load_bundle(path, cache_experts=1).predict(image) for image in images())]
    assert [row["experts"] for row in report["images"]] == expected
