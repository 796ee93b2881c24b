"""Every registry model through every export backend, against eager PyTorch.

The split follows each model's routing kind: a dense ViT is one graph; the per-image MoEs (Mobile V-MoE, Hard MoE)
split into a router and one graph per expert; the per-token MoEs (V-MoE, Experts Choice, Soft MoE, WideNet) export
whole, every expert in one graph that reports the token slots each expert filled. Each bundle must give the eager
logits and the eager experts (chosen, or used), through the Python runtime and, for ExecuTorch, the native runner.

ONNX runs for every model by default (seconds each); ExecuTorch under `-m slow` (10-20 s an export on 2 cores; the
fast set lowers a split Mobile V-MoE to ExecuTorch elsewhere); Core ML converts and saves (it cannot run off macOS)
by default for vmoe, the rest under `-m slow`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import built_once, needs_build, tiny_model
from PIL import Image

from mobile_moe.app.cli import main
from mobile_moe.errors import UsageError
from mobile_moe.export.bundle import export_bundle
from mobile_moe.export.graphs import split_model
from mobile_moe.export.manifest import read_manifest
from mobile_moe.export.manifest_schema import validate_manifest
from mobile_moe.export.runtime import load_bundle
from mobile_moe.models.costs import costs
from mobile_moe.models.registry import MODELS, list_models

pytestmark = pytest.mark.export

LAYOUT_OF_ROUTING = {
    "none": "dense",
    "image": "expert-paths",
    "cluster": "expert-paths",
    "token": "whole",
    "expert": "whole",
    "soft": "whole",
}
WHOLE = [name for name in list_models() if LAYOUT_OF_ROUTING[MODELS[name].routing] == "whole"]
DEFAULT_COREML = ("vmoe",)


def sample_images(count: int = 6) -> torch.Tensor:
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(21))


def spread_clusters(model) -> None:
    """Give an (unfitted) Hard MoE a PCA and centroids taken from real gater features, so that images reach
    different experts (until fitted, every centroid is 0 and every image goes to expert 0)."""
    images = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        features = model.image_features(images)  # (12, D)
        mean = features.mean(0)
        components = torch.linalg.svd(features - mean, full_matrices=False).Vh[: model.config.pca_dims]  # (P, D)
        probe = model.image_features(sample_images())  # (6, D): the centroids are 4 of the test images themselves
        centroids = (probe[: model.config.num_experts] - mean) @ components.T  # (E, P)
    model.router.set_clusters(mean, components, centroids)


def reference_model(name: str):
    model = tiny_model(name).eval()
    if name == "hard-moe":
        spread_clusters(model)
    return model


def eager_experts(model, images: torch.Tensor) -> tuple[torch.Tensor, list[list[int]], list[list[float]]]:
    """Eager logits, and per image the experts and gates a bundle must report: the chosen experts of a per-image
    MoE; the experts a per-token MoE used (token slots summed over its expert sets > 0), with their slot shares."""
    with torch.no_grad():
        output = model(images)
    if output.routing is not None:
        return output.logits, output.routing.experts.tolist(), output.routing.gates.tolist()
    if output.stats is None:
        return output.logits, [[] for _ in images], [[] for _ in images]
    counts = output.stats.expert_tokens.reshape(len(images), -1, model.config.num_experts).sum(1)  # (N, E)
    experts = [torch.nonzero(row > 0).flatten().tolist() for row in counts]
    gates = [(row[used] / row.sum()).tolist() for row, used in zip(counts, experts, strict=True)]
    return output.logits, experts, gates


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = reference_model(name)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def bundles(models, tmp_path_factory):
    """(name, backend) -> bundle directory, exported once per session (faults.whole_bundle is this module's vmoe
    ExecuTorch bundle: the fault suites share it)."""

    def get(name: str, backend: str):
        return built_once(tmp_path_factory, f"reference-{name}-{backend}",
                          lambda out: export_bundle(models(name), out, backend))  # fmt: skip

    return get


def _backend_cases() -> list:
    # Mobile V-MoE's ONNX bundle in the slow set: tests/export/test_export_bundles.py checks one against eager
    cases = [pytest.param(name, "onnx", id=f"{name}-onnx", marks=(pytest.mark.slow,) if name == "mobile-vmoe" else ())
             for name in list_models()]  # fmt: skip
    for name in list_models():
        cases.append(pytest.param(name, "executorch", marks=pytest.mark.slow, id=f"{name}-executorch"))
    return cases


# --- the split -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list_models())
def test_split_follows_routing(name, models):
    model = models(name)
    cfg = model.config
    split = split_model(model)
    assert split.layout == LAYOUT_OF_ROUTING[cfg.routing]
    if split.layout == "whole":
        (graph,) = split.graphs
        assert [(t.name, tuple(t.shape)) for t in graph.outputs] == [
            ("logits", (1, cfg.num_classes)),
            ("expert_tokens", (1, cfg.expert_sets, cfg.num_experts)),
        ]
        assert graph.params == sum(p.numel() for p in model.parameters())  # every expert inside
    if split.layout == "expert-paths":
        assert [g.expert for g in split.graphs] == [None, *range(cfg.num_experts)]


@pytest.mark.parametrize("name", WHOLE)
def test_per_token_models_refuse_split_flags(name, models):
    model = models(name)
    for options, flag in [({"layout": "per-block"}, "--layout per-block"), ({"monolithic": True}, "--monolithic")]:
        with pytest.raises(UsageError, match=f"{flag} does not apply to {name}") as error:
            split_model(model, **options)
        assert "\n" not in str(error.value) and "exports whole" in str(error.value)


def test_hard_moe_refuses_per_block(models):
    with pytest.raises(UsageError, match="per-block does not apply to hard-moe"):
        split_model(models("hard-moe"), layout="per-block")


@pytest.mark.slow  # an export of its own (4 s); Hard MoE's split bundle is in the fast set (test_bundle_matches_eager)
def test_hard_moe_has_a_monolithic_export(models, tmp_path):
    model = models("hard-moe")
    manifest = export_bundle(model, tmp_path / "mono", "onnx", monolithic=True, sample_images=sample_images()).to_json()
    assert manifest["composition"]["layout"] == "monolithic" and manifest["routing"] == "cluster"
    _, experts, _ = eager_experts(model, sample_images())
    bundle = load_bundle(tmp_path / "mono")
    assert [bundle.predict(image).experts for image in sample_images()] == experts


# --- bundles against eager PyTorch ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "backend"), _backend_cases())
def test_bundle_matches_eager(name, backend, models, bundles):
    model, images = models(name), sample_images()
    manifest = read_manifest(bundles(name, backend)).to_json()
    assert manifest["composition"]["layout"] == LAYOUT_OF_ROUTING[model.config.routing]
    assert manifest["routing"] == model.config.routing
    assert manifest["params_active_max"] == costs(model.config).params_active
    assert manifest["parity"]["passed"] and manifest["parity"].get("expert_agreement", 1.0) == 1.0
    logits, experts, gates = eager_experts(model, images)
    if name == "hard-moe":
        assert len({tuple(e) for e in experts}) > 1, "precondition: images should reach several experts"
    bundle = load_bundle(bundles(name, backend))
    for image, eager, chosen, weights in zip(images, logits, experts, gates, strict=True):
        prediction = bundle.predict(image)
        np.testing.assert_allclose(prediction.logits, eager.numpy(), atol=1e-5, rtol=1e-4)
        assert prediction.experts == chosen
        assert prediction.gates == pytest.approx(weights, abs=1e-6)


@pytest.mark.parametrize("name", WHOLE)
def test_whole_bundle_loads_every_expert_and_says_so(name, bundles):
    manifest = read_manifest(bundles(name, "onnx")).to_json()
    (graph,) = manifest["graphs"]
    assert graph["role"] == "whole" and graph["expert"] is None
    assert validate_manifest(manifest).params_loaded_max() == graph["params"] >= manifest["params_active_max"]
    assert manifest["sizes"]["resident_bytes"] == manifest["sizes"]["total_bytes"] == graph["bytes"]
    bundle = load_bundle(bundles(name, "onnx"))
    assert bundle.loaded_graphs == ["whole"]  # loaded at open: every image needs all of it


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in DEFAULT_COREML else (pytest.mark.slow,)) for n in list_models()]
)
def test_coreml_converts_and_saves(name, models, tmp_path):
    import coremltools as ct

    manifest = export_bundle(models(name), tmp_path / "b", "coreml", sample_images=sample_images(3)).to_json()
    assert manifest["parity"]["passed"]  # off macOS: the split modules in PyTorch, as the runtime composes them
    for graph in manifest["graphs"]:
        spec = ct.models.MLModel(str(tmp_path / "b" / graph["file"]), skip_model_load=True).get_spec()
        assert [o.name for o in spec.description.output] == [o["name"] for o in graph["outputs"]]


@pytest.mark.slow
def test_int8_executorch_whole_bundle(models, tmp_path):
    model, images = models("vmoe"), sample_images(16)
    manifest = export_bundle(
        model, tmp_path / "q", "executorch", quantize="int8", calibration_images=images, sample_images=images[:4]
    ).to_json()
    assert manifest["graphs"][0]["backend_details"]["delegates"] >= 1
    assert manifest["parity"]["passed"] is None and manifest["parity"]["max_abs_prob_error"] < 0.05
    assert manifest["quantization"]["bytes"] < manifest["quantization"]["fp32_weight_bytes"]


# --- predict, the native runner, bench -----------------------------------------------------------------------------


def test_predict_json_reports_the_experts_a_whole_bundle_used(bundles, models, tmp_path, capsys):
    png = tmp_path / "image.png"
    Image.fromarray((np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)).save(png)
    capsys.readouterr()
    assert main(["predict", str(bundles("vmoe", "onnx")), str(png), "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["experts"] == sorted(result["experts"]) and result["experts"]
    assert sum(result["gates"]) == pytest.approx(1.0) and all(g > 0 for g in result["gates"])


@needs_build
@pytest.mark.slow
@pytest.mark.parametrize("name", ["vmoe"])
def test_native_runner_matches_python_runtime(name, runner, bundles, tmp_path):
    from mobile_moe.device_bench.native_runner import run_native
    from mobile_moe.device_bench.round_settings import RoundSettings

    images = sample_images().numpy()
    images.tofile(tmp_path / "images.f32")
    report = run_native(
        runner, bundles(name, "executorch"), tmp_path / "images.f32", RoundSettings(iterations=2, warmup=0)
    )
    python = load_bundle(bundles(name, "executorch"))
    expected = [python.predict(image) for image in images]
    assert report["layout"] == LAYOUT_OF_ROUTING[MODELS[name].routing]
    assert [row["experts"] for row in report["images"]] == [p.experts for p in expected]
    np.testing.assert_allclose([row["logits"] for row in report["images"]], [p.logits for p in expected], atol=1e-4)
    for row, prediction in zip(report["images"], expected, strict=True):
        assert row["gates"] == pytest.approx(prediction.gates, abs=1e-6)


@pytest.mark.slow  # two bundles benchmarked on two runtimes: in CI's slow set, which keeps `make test` within 5 minutes
@needs_build
def test_bench_puts_split_and_whole_side_by_side(runner, bundles, tmp_path):
    """Bytes and parameters loaded per image, honestly: the split Hard MoE loads its router and one expert, the
    whole V-MoE loads every expert for every image."""
    split, whole = bundles("hard-moe", "executorch"), bundles("vmoe", "executorch")
    argv = ["bench", str(split), str(whole), "--runtime", "native", "--runner", str(runner), "--iterations", "2"]
    assert main([*argv, "--warmup", "0", "--rounds", "1", "--images", "6", "--out", str(tmp_path / "out")]) == 0
    runs = {run["kind"]: run for run in json.loads((tmp_path / "out" / "results.json").read_text())["runs"]}
    split_manifest, whole_manifest = read_manifest(split).to_json(), read_manifest(whole).to_json()
    (whole_graph,) = whole_manifest["graphs"]
    assert runs["whole"]["bytes_loaded_per_image"] == whole_graph["bytes"]
    assert runs["whole"]["params_loaded_per_image"] == whole_graph["params"] >= runs["whole"]["params_active"]
    router, *experts = split_manifest["graphs"]
    chosen = [row["experts"][0] for row in runs["split"]["raw_first_round"]["images"]]
    assert runs["split"]["bytes_loaded_per_image"] == pytest.approx(
        router["bytes"] + np.mean([experts[e]["bytes"] for e in chosen])
    )
    assert runs["split"]["params_loaded_per_image"] == runs["split"]["params_active"]  # exactly what it computes with
    assert runs["whole"]["expert_change_rate"] is None and runs["whole"]["cache_hit_rate"] == {}
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"split {split.name} vs whole {whole.name}" in report


@pytest.mark.slow  # an ExecuTorch export per block: in CI's slow set, which keeps `make test` within 5 minutes
def test_widenet_shared_layers_are_delegated_once_per_block(models, tmp_path):
    """WideNet's one attention and MoE layer serve every block: export traces a view with one module object per
    block (sharing every Parameter), so XNNPACK takes each block's linears instead of leaving all of them on
    ExecuTorch's portable kernels (a module used in several blocks is one partition it declines)."""
    model = models("widenet")
    view = model.graph_capture_view()
    assert {id(p) for p in view.parameters()} == {id(p) for p in model.parameters()}  # shares, copies nothing
    assert list(view.state_dict()) != list(model.state_dict()) and "block_views" not in dict(model.named_modules())
    images = sample_images(2)
    with torch.no_grad():
        torch.testing.assert_close(view(images).logits, model(images).logits, rtol=0, atol=0)
    manifest = export_bundle(model, tmp_path / "widenet", "executorch").to_json()
    leftover = manifest["graphs"][0]["backend_details"]["undelegated_ops"]
    assert not [op for op in leftover if op in ("aten.addmm.default", "aten.mm.default", "aten.linear.default")]
