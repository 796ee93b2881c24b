"""ExecuTorch and ONNX bundles against the eager model: logits, expert choices, lazy loading, LRU, composition."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import bundle_images, bundle_model, tiny_model

from mobile_moe.errors import UsageError
from mobile_moe.export.bundle import export_bundle
from mobile_moe.export.executorch_backend import PORTABLE_BY_DESIGN
from mobile_moe.export.manifest import read_manifest
from mobile_moe.export.runtime import load_bundle

pytestmark = pytest.mark.export


def images_for_experts(model) -> tuple[torch.Tensor, list[int]]:
    """conftest's bundle_images and the expert the eager model sends each one to (k = 1)."""
    images = bundle_images()
    with torch.no_grad():
        experts = model(images).routing.experts[:, 0].tolist()
    return images, experts


@pytest.fixture(scope="module")
def moe():
    return bundle_model()


@pytest.fixture(params=["executorch", "onnx"])
def bundle_dir(request, bundle, onnx_bundle):
    """conftest's session bundles of `moe`: each exported once for the whole test run."""
    return bundle if request.param == "executorch" else onnx_bundle


def test_bundle_reproduces_eager_logits_and_experts(moe, bundle_dir):
    images, experts = images_for_experts(moe)
    assert len(set(experts)) == moe.config.num_experts, "test images should reach every expert"
    bundle = load_bundle(bundle_dir)
    with torch.no_grad():
        reference = moe(images)
    for image, logits, expert, gate in zip(
        images, reference.logits, experts, reference.routing.gates[:, 0], strict=True
    ):
        prediction = bundle.predict(image)
        np.testing.assert_allclose(prediction.logits, logits.numpy(), atol=1e-5, rtol=1e-4)
        assert prediction.experts == [expert]
        assert prediction.gates == pytest.approx([float(gate)], abs=1e-6)
        assert {"router", "load", "experts", "total"} <= set(prediction.timings)


def test_manifest_describes_graphs(bundle_dir):
    manifest = read_manifest(bundle_dir).to_json()
    assert manifest["format"] == "mobile-moe-bundle" and manifest["version"] == 2
    assert (manifest["num_experts"], manifest["top_k"]) == (4, 1)
    assumed = {"policy": "stretch", "origin": "assumed"}  # exported without a run: no eval resize policy known
    assert manifest["input"] == {"shape": [1, 3, 32, 32], "dtype": "float32", "mean": [0.5] * 3, "std": [0.25] * 3,
                                 "resize": assumed}  # fmt: skip
    graphs = {graph["name"]: graph for graph in manifest["graphs"]}
    assert set(graphs) == {"router", "expert_0", "expert_1", "expert_2", "expert_3"}
    assert [o["name"] for o in graphs["router"]["outputs"]] == ["tokens", "router_probs"]
    assert graphs["router"]["outputs"][0]["shape"] == [1, 16, 32]  # 16 patches; mean pooling: no class token
    assert [i["name"] for i in graphs["expert_1"]["inputs"]] == ["tokens", "gate"]
    assert graphs["expert_1"]["role"] == "expert" and graphs["expert_1"]["expert"] == 1
    for graph in graphs.values():
        assert (bundle_dir / graph["file"]).stat().st_size == graph["bytes"]
        if graph.get("weights"):
            assert (bundle_dir / graph["weights"]["file"]).stat().st_size == graph["weights"]["bytes"]
        assert len(graph["sha256"]) == 64 and graph["params"] > 0
        # ExecuTorch: everything in XNNPACK but the LayerNorms we keep portable on purpose
        assert set(graph["backend_details"].get("undelegated_ops", [])) <= PORTABLE_BY_DESIGN
    parity = manifest["parity"]
    assert parity["passed"] and parity["expert_agreement"] == 1.0 and parity["max_abs_prob_error"] <= 1e-4
    assert manifest["sizes"]["resident_plus_one_expert_bytes"] < manifest["sizes"]["total_bytes"]


def test_experts_load_lazily_and_lru_evicts(moe, bundle_dir):
    images, experts = images_for_experts(moe)
    first = experts.index(0)
    second = experts.index(1)
    bundle = load_bundle(bundle_dir, cache_experts=1)
    assert bundle.loaded_graphs == ["router"]
    prediction = bundle.predict(images[first])
    assert bundle.loaded_graphs == ["router", "expert_0"] and prediction.timings["load"] > 0
    assert bundle.predict(images[first]).timings["load"] == 0  # cached
    bundle.predict(images[second])
    assert bundle.loaded_graphs == ["router", "expert_1"]  # expert 0 evicted
    unlimited = load_bundle(bundle_dir, cache_experts=0)
    unlimited.predict(images[first])
    unlimited.predict(images[second])
    assert sorted(unlimited.loaded_graphs) == ["expert_0", "expert_1", "router"]
    assert unlimited.loaded_experts == [0, 1]


def test_k2_composition_equals_eager(tmp_path):
    model = tiny_model("mobile-vmoe", num_experts=3, top_k=2).eval()
    manifest = export_bundle(model, tmp_path / "k2", "onnx").to_json()
    composition = manifest["composition"]
    assert composition["layout"] == "per-block" and len(composition["blocks"]) == 2
    # attention lives once (block_shared), the expert graphs hold only MLPs
    assert sorted({graph["role"] for graph in manifest["graphs"]}) == ["block_expert", "block_shared", "head", "router"]
    assert composition["blocks"][1]["experts"] == ["block1_expert0", "block1_expert1", "block1_expert2"]
    bundle = load_bundle(tmp_path / "k2", cache_experts=2)
    for experts in predictions_match_eager(bundle, model, count=6):
        loaded = [name for name in bundle.loaded_graphs if "_expert" in name]
        assert sorted(loaded) == sorted(f"block{b}_expert{e}" for b in range(2) for e in experts)


def predictions_match_eager(bundle, model, count: int):
    """Predict `count` seeded images one by one, each checked against the eager model's logits and experts; yields
    the experts after each image's prediction (so a caller can check what is loaded then)."""
    images = torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = model(images)
    for image, logits, experts in zip(images, reference.logits, reference.routing.experts, strict=True):
        prediction = bundle.predict(image)
        np.testing.assert_allclose(prediction.logits, logits.numpy(), atol=1e-5, rtol=1e-4)
        assert prediction.experts == experts.tolist()
        yield experts.tolist()


@pytest.mark.slow  # eight graphs exported: the fast set's per-block layout is test_k2_composition_equals_eager's
def test_shared_attention_layout_for_k1(tmp_path):
    """k = 1 with the per-block layout: attention lives once, expert graphs hold only MLPs."""
    model = tiny_model("mobile-vmoe", num_experts=2).eval()
    manifest = export_bundle(model, tmp_path / "b", "onnx", layout="per-block").to_json()
    roles = sorted({graph["role"] for graph in manifest["graphs"]})
    assert roles == ["block_expert", "block_shared", "head", "router"]
    assert manifest["parity"]["passed"]


@pytest.mark.parametrize("backend", [pytest.param("executorch", marks=pytest.mark.slow), "onnx"])  # slow: two exports
def test_monolithic_and_dense_exports_run(tmp_path, backend):
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    # Hard MoE's whole expert blocks in the slow set only: its dense dispatch is checked against eager in the fast set.
    monolithic = ["mobile-vmoe", *(["hard-moe"] if backend == "executorch" else [])]
    for name, options in [*((name, {"monolithic": True}) for name in monolithic), ("vit", {})]:
        model = tiny_model(name).eval()
        manifest = export_bundle(model, tmp_path / name, backend, **options).to_json()
        assert [graph["role"] for graph in manifest["graphs"]] == ["monolithic" if options else "dense"]
        if backend == "executorch":  # every expert's linears in XNNPACK (moe.unstacked_view), none on the portables
            left = manifest["graphs"][0]["backend_details"]["undelegated_ops"]
            # A Hard MoE's router multiplies by its k-means buffers (PCA, centroids): two portable mm, as in its split
            # bundle's router graph.
            matmuls = [op for op in left if op in ("aten.addmm.default", "aten.mm.default", "aten.linear.default")]
            assert matmuls == (["aten.mm.default"] * 2 if name == "hard-moe" else []), name
        bundle = load_bundle(tmp_path / name)
        with torch.no_grad():
            reference = model(images)
        for i, image in enumerate(images):
            prediction = bundle.predict(image)
            np.testing.assert_allclose(prediction.logits, reference.logits[i].numpy(), atol=1e-5, rtol=1e-4)
            expected = [] if name == "vit" else reference.routing.experts[i].tolist()
            assert prediction.experts == expected


def _check_int8_bundle(model, tmp_path, backend):
    images = torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    labels = torch.arange(32) % 7
    manifest = export_bundle(
        model, tmp_path / "q", backend, quantize="int8", calibration_images=images, val_data=(images, labels)
    ).to_json()
    quantization = manifest["quantization"]
    assert quantization["validation"]["images"] == 32
    assert abs(quantization["validation"]["top1_change"]) <= 0.25
    assert quantization["bytes"] < quantization["fp32_weight_bytes"]
    assert manifest["parity"]["passed"] is None  # measured, not held to the fp32 bound
    assert manifest["parity"]["max_abs_prob_error"] < 0.05
    bundle = load_bundle(tmp_path / "q")
    with torch.no_grad():
        reference = torch.softmax(model(images[:4]).logits, -1).numpy()
    probs = np.stack([torch.softmax(torch.from_numpy(bundle.predict(x).logits), -1).numpy() for x in images[:4]])
    assert np.abs(probs - reference).max() < 0.05
    json.dumps(manifest)  # plain JSON all the way down
    return manifest


def test_int8_onnx_moe_bundle_runs_close_to_fp32(tmp_path):
    _check_int8_bundle(tiny_model("mobile-vmoe", num_experts=2).eval(), tmp_path, "onnx")


@pytest.mark.slow  # two ExecuTorch exports: in CI's slow set, which keeps `make test` within 5 minutes
def test_int8_executorch_bundle_runs_close_to_fp32(tmp_path):
    """One graph (dense ViT) keeps the default suite fast; the MoE bundle below runs the same flow per expert."""
    manifest = _check_int8_bundle(tiny_model("vit").eval(), tmp_path, "executorch")
    assert manifest["graphs"][0]["backend_details"]["delegates"] >= 1


@pytest.mark.slow
def test_int8_executorch_moe_bundle_runs_close_to_fp32(tmp_path):
    _check_int8_bundle(tiny_model("mobile-vmoe", num_experts=2).eval(), tmp_path, "executorch")


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [1, 2])
def test_executorch_per_block_layout_equals_eager(tmp_path, top_k, runner):
    """The per-block layout equals eager PyTorch in the Python runtime, and the native runner gives its answers with
    the fewest experts resident that an image's top_k allows (fewer is one line: an image's experts run together)."""
    from mobile_moe.device_bench.native_runner import run_native
    from mobile_moe.device_bench.round_settings import RoundSettings
    from mobile_moe.device_bench.workload import random_workload, write_raw
    from mobile_moe.errors import UsageError

    model = tiny_model("mobile-vmoe", num_experts=3, top_k=top_k).eval()
    manifest = export_bundle(model, tmp_path / "b", "executorch", layout="per-block").to_json()
    assert all(set(graph["backend_details"]["undelegated_ops"]) <= PORTABLE_BY_DESIGN for graph in manifest["graphs"])
    assert len(list(predictions_match_eager(load_bundle(tmp_path / "b"), model, count=4))) == 4
    shape = read_manifest(tmp_path / "b").input.shape
    images = random_workload(shape, count=4, seed=1)
    settings = RoundSettings(iterations=1, warmup=0, cache_experts=top_k, switch_repeats=0)
    report = run_native(runner, tmp_path / "b", write_raw(images, tmp_path / "images.f32"), settings)
    runtime = load_bundle(tmp_path / "b", cache_experts=top_k)
    expected = [runtime.predict(image) for image in images.images]
    assert [row["experts"] for row in report["images"]] == [p.experts for p in expected]
    np.testing.assert_allclose([row["logits"] for row in report["images"]], [p.logits for p in expected], atol=1e-4)
    if top_k > 1:
        refusal = rf"cache_experts \(--cache-experts\) 1 is fewer than the bundle's top_k, {top_k}.*at least {top_k}"
        with pytest.raises(UsageError, match=refusal):
            run_native(runner, tmp_path / "b", tmp_path / "images.f32", RoundSettings(iterations=1, cache_experts=1))


# --- what the reference-model work changed, and what it must not have -----------------------------------------------

MANIFEST_KEYS = {
    "format", "version", "backend", "model", "num_experts", "top_k", "input", "class_names", "super_class_names",
    "composition", "graphs", "sizes", "precision", "source", "parity",
}  # fmt: skip
GRAPH_KEYS = {
    "name", "role", "expert", "file", "sha256", "bytes", "params", "inputs", "outputs", "backend_details",
    "export_seconds",
}  # fmt: skip
IMAGE_KEYS = {"routing", "params_active_max"}  # what an image touches


def test_manifest_keeps_its_fields_and_adds_what_an_image_touches(moe, bundle_dir):
    from mobile_moe.models.costs import costs

    manifest = read_manifest(bundle_dir).to_json()
    assert set(manifest) == MANIFEST_KEYS | IMAGE_KEYS
    # an ExecuTorch expert also names its own weights file (the experts share one program)
    own_weights = {"weights"} if manifest["backend"] == "executorch" else set()
    assert all(
        set(graph) == GRAPH_KEYS | (own_weights if graph["role"] == "expert" else set()) for graph in manifest["graphs"]
    )
    assert manifest["routing"] == "image" and manifest["params_active_max"] == costs(moe.config).params_active
    # k = 1: the router and one expert path hold exactly the parameters one image computes with
    router, expert = (next(g for g in manifest["graphs"] if g["role"] == role) for role in ("router", "expert"))
    assert router["params"] + expert["params"] == manifest["params_active_max"]


def test_a_bundle_of_the_format_before_version_2_is_refused_in_one_line(bundle_dir, tmp_path):
    """Format 1 (routing, params_active_max and input.resize optional) is not read: a bundle of it is exported again."""
    import shutil

    old = shutil.copytree(bundle_dir, tmp_path / "old")
    manifest = json.loads((old / "manifest.json").read_text())
    for key in IMAGE_KEYS:
        del manifest[key]
    del manifest["input"]["resize"]
    manifest["version"] = 1
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UsageError) as refused:
        read_manifest(old)
    assert str(refused.value) == (
        f"{old / 'manifest.json'} is a bundle manifest of format version 1; this mobile-moe reads version 2: export "
        "the bundle again with `mobile-moe export`"
    )


@pytest.mark.parametrize("descending", [False, True])
def test_sort_rewrite_is_the_stable_sort(descending):
    """Every backend gets aten.sort as ranks (mobile_moe/export/decompositions.py): the same values and indices as the
    stable sort, ties in index order, along any dim."""
    from mobile_moe.export.decompositions import sort_stable

    generator = torch.Generator().manual_seed(0)
    for shape, dim in [((7,), 0), ((3, 9), -1), ((2, 5, 4), 1), ((6, 3), 0)]:
        x = torch.randint(0, 3, shape, generator=generator).float()  # mostly ties
        x.view(-1)[0] = float("-inf")
        expected = torch.sort(x, dim=dim, descending=descending, stable=True)
        values, indices = sort_stable(x, dim=dim, descending=descending)
        assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)


def test_onnx_top_k_with_ties_matches_eager_and_sortless_graphs_keep_their_bytes(moe, tmp_path):
    """The top-k rule (a stable sort) exports to ONNX through the rewrite and keeps the tie order; a graph without a
    sort exports to exactly the bytes torch.onnx.export writes for the module itself."""
    import onnxruntime as ort

    from mobile_moe.export.artifact import file_digest
    from mobile_moe.export.graphs import split_model
    from mobile_moe.export.onnx_backend import OPSET, export_onnx
    from mobile_moe.models.routers import top_k

    class TopK(torch.nn.Module):
        def forward(self, scores):
            values, experts = top_k(scores, 3)
            return values, experts.float()

    scores = torch.tensor([[0.2, 0.5, 0.2, 0.5, 0.1, 0.5]])  # ties: experts 1, 3, 5
    export_onnx(TopK(), (scores,), tmp_path / "topk.onnx", input_names=["scores"], output_names=["values", "experts"])
    session = ort.InferenceSession(str(tmp_path / "topk.onnx"), providers=["CPUExecutionProvider"])
    values, experts = session.run(None, {"scores": scores.numpy()})
    assert experts.tolist() == [[1.0, 3.0, 5.0]] and values[0].tolist() == pytest.approx([0.5, 0.5, 0.5])

    router = split_model(moe).graphs[0]
    names = {"input_names": ["images"], "output_names": ["tokens", "router_probs"]}
    export_onnx(router.module, router.example_inputs(), tmp_path / "ours.onnx", **names)
    with torch.no_grad():
        torch.onnx.export(
            router.module, router.example_inputs(), str(tmp_path / "plain.onnx"), dynamo=True, opset_version=OPSET,
            external_data=False, verbose=False, **names,
        )  # fmt: skip
    assert file_digest(tmp_path / "ours.onnx") == file_digest(tmp_path / "plain.onnx")


def test_a_graph_that_keeps_state_is_refused():
    """A bundle's graphs hold nothing between runs (the native runner lets them share planned memory), so a module
    that mutates a buffer when it runs is refused at export, naming the buffer."""
    from mobile_moe.export.executorch_backend import lower

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(1))

        def forward(self, x):
            self.calls.add_(1)
            return x * 2

    with pytest.raises(ValueError, match=r"Counter mutates buffers \['calls'\]"):
        lower(Counter(), (torch.ones(3),))
