"""Core ML bundles: packages written, loadable without compiling, named like the manifest says. Prediction needs
macOS; elsewhere the runtime says so clearly."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import built_once, tiny_model

from mobile_moe.errors import UsageError
from mobile_moe.export.bundle import export_bundle
from mobile_moe.export.manifest import read_manifest
from mobile_moe.export.runtime import load_bundle

pytestmark = pytest.mark.export


@pytest.fixture(scope="module")
def coreml_bundle(tmp_path_factory):
    """Exported once per session (pytest-xdist may run this module's tests on both workers)."""
    model = tiny_model("mobile-vmoe", num_experts=2).eval()
    names = [f"c{i}" for i in range(7)]
    export = lambda out: export_bundle(model, out, "coreml", class_names=names)  # noqa: E731
    out = built_once(tmp_path_factory, "coreml-two-experts", export)
    return out, read_manifest(out).to_json(), model


def test_packages_load_and_match_manifest(coreml_bundle):
    import coremltools as ct

    out, manifest, _ = coreml_bundle
    assert manifest["precision"] == "fp16"
    for graph in manifest["graphs"]:
        path = out / graph["file"]
        assert path.suffix == ".mlpackage" and path.is_dir() and graph["bytes"] > 0
        spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
        assert [i.name for i in spec.description.input] == [i["name"] for i in graph["inputs"]]
        assert [o.name for o in spec.description.output] == [o["name"] for o in graph["outputs"]]
        shapes = [list(i.type.multiArrayType.shape) for i in spec.description.input]
        assert shapes == [i["shape"] for i in graph["inputs"]]
        assert all(i.shortDescription for i in spec.description.input)
        assert spec.specificationVersion >= 8  # iOS 17


def test_split_checked_in_pytorch_off_macos(coreml_bundle):
    _, manifest, _ = coreml_bundle
    parity = manifest["parity"]
    if sys.platform == "darwin":
        assert parity["checked_on"] == "coreml runtime"
    else:
        assert parity["checked_on"].startswith("split modules") and parity["passed"]


def test_prediction(coreml_bundle):
    out, _, model = coreml_bundle
    image = torch.randn(3, 32, 32)
    if sys.platform != "darwin":
        with pytest.raises(UsageError, match="only on macOS"):
            load_bundle(out)
        pytest.skip("Core ML prediction needs macOS (Core ML is an Apple framework); checked the clear error instead")
    prediction = load_bundle(out).predict(image)
    with torch.no_grad():
        reference = model(image[None])
    assert prediction.experts == reference.routing.experts[0].tolist()
    assert torch.allclose(torch.from_numpy(prediction.logits), reference.logits[0], atol=5e-2)  # fp16


@pytest.mark.slow  # three conversions of their own (5 s); the fast set converts the module's bundle above
def test_int8_and_fp32_packages(tmp_path):
    model = tiny_model("vit").eval()
    fp32 = export_bundle(model, tmp_path / "fp32", "coreml", fp32=True).to_json()
    linear = export_bundle(model, tmp_path / "int8", "coreml", quantize="int8").to_json()
    palette = export_bundle(model, tmp_path / "pal", "coreml", quantize="int8", coreml_compression="palette4").to_json()
    assert fp32["precision"] == "fp32" and linear["precision"] == "linear8" and palette["precision"] == "palette4"
    assert palette["sizes"]["total_bytes"] < linear["sizes"]["total_bytes"] < fp32["sizes"]["total_bytes"]
    assert linear["quantization"]["validation"]["measured"] is False


def _operations(package: Path):
    """Every operation of a package's ML program."""
    import coremltools as ct

    spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
    for function in spec.mlProgram.functions.values():
        for block in function.block_specializations.values():
            yield from block.operations


def _dims(value) -> list[int]:
    return [d.constant.size for d in value.type.tensorType.dimensions]


def _uncompressed_weights(package: Path) -> list[str]:
    """Names of the plain constants larger than coremltools' weight threshold (2048 elements): weights no
    compression reached."""
    return [op.outputs[0].name for op in _operations(package)
            if op.type == "const" and math.prod(_dims(op.attributes["val"])) > 2048]  # fmt: skip


def _constexpr_weights(package: Path) -> list[tuple[str, str, list[int], list[int]]]:
    """(op, weight dtype, weight shape, scale shape) of each compressed weight in a package's ML program."""
    from coremltools.proto import MIL_pb2

    found = []
    for op in _operations(package):
        if op.type.startswith("constexpr"):
            # iOS 17's op holds its values as attributes (`quantized_data`), iOS 18's as inputs (`data`)
            values = {**op.attributes, **{name: arg.arguments[0].value for name, arg in op.inputs.items()}}
            data, scale = values.get("data", values.get("quantized_data")), values["scale"]
            dtype = MIL_pb2.DataType.Name(data.type.tensorType.dataType)
            found.append((op.type, dtype, _dims(data), _dims(scale)))
    return found


@pytest.mark.slow  # three Core ML conversions (4 s)
def test_experts_in_4_bit_blocks_and_the_rest_in_8_bits(tmp_path):
    """--quantize int8 --coreml-compression experts=linear4,rest=linear8: each expert package holds int4 weights with
    a scale per 32 inputs (coremltools' blockwise op, so an iOS 18 package); the router keeps per-channel int8 on
    iOS 17; the manifest says so, per graph and in one line."""
    model = tiny_model("mobile-vmoe", num_experts=2).eval()
    out = tmp_path / "bundle"
    manifest = export_bundle(
        model, out, "coreml", quantize="int8", coreml_compression="experts=linear4,rest=linear8", layout="expert-paths"
    ).to_json()
    assert manifest["precision"] == "experts linear4, rest linear8"
    graphs = {graph["role"]: graph for graph in manifest["graphs"]}
    assert set(graphs) == {"router", "expert"}
    for graph in manifest["graphs"]:
        four_bit = graph["role"] == "expert"
        details = graph["backend_details"]
        assert (details["weights"], details["target"]) == (("linear4", "iOS18") if four_bit else ("linear8", "iOS17"))
        weights = _constexpr_weights(out / graph["file"])
        assert weights, graph["name"]
        for op, dtype, shape, scale in weights:
            if four_bit:  # one scale per block of 32 inputs of each output channel
                assert (op, dtype, scale) == ("constexpr_blockwise_shift_scale", "INT4", [shape[0], shape[1] // 32])
            else:
                assert (op, dtype) == ("constexpr_affine_dequantize", "INT8")


@pytest.mark.slow  # a Core ML conversion (1 s)
def test_linear4_leaves_no_weight_uncompressed(tmp_path):
    """A weight whose inputs are no whole blocks of 32 (the patch embedding's 3 colour channels) is int8 per channel,
    where coremltools alone would keep it in fp16; every Linear is int4 in blocks."""
    out = tmp_path / "bundle"
    manifest = export_bundle(tiny_model("vit").eval(), out, "coreml", quantize="int8", coreml_compression="linear4")
    package = out / manifest.to_json()["graphs"][0]["file"]
    assert _uncompressed_weights(package) == []
    weights = _constexpr_weights(package)
    patch_embedding = [w for w in weights if w[2][1:] == [3, 8, 8]]
    assert [dtype for _, dtype, _, _ in patch_embedding] == ["INT8"]
    blocked = [w for w in weights if w not in patch_embedding]
    assert blocked and {(op, dtype) for op, dtype, _, _ in blocked} == {("constexpr_blockwise_shift_scale", "INT4")}
