"""`export --quantize`: one scheme or one per part (mobile_moe/export/quantization.py), refused in one line where a
backend or layout cannot take it; an 8da4w-expert bundle computes its own eager quantized modules, natively too, and
loads only the experts an image picks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import needs_build, tiny_model

from mobile_moe.errors import UsageError
from mobile_moe.export.bundle import export_bundle
from mobile_moe.export.quantization import CoreMLCompression, Quantization

pytestmark = pytest.mark.export


@pytest.mark.parametrize(
    ("spelling", "experts", "rest"),
    [("none", "none", "none"), ("int8", "int8", "int8"), ("8da4w", "8da4w", "8da4w"),
     ("experts=8da4w,rest=int8", "8da4w", "int8"), ("rest=none,experts=int8", "int8", "none")],
)  # fmt: skip
def test_one_spelling_gives_each_part_its_scheme(spelling, experts, rest):
    schemes = Quantization.parse(spelling)
    assert (schemes.experts, schemes.rest) == (experts, rest)
    assert schemes.of("expert") == schemes.of("block_expert") == experts
    assert schemes.of("router") == schemes.of("head") == schemes.of("block_shared") == rest


@pytest.mark.parametrize(
    ("spelling", "experts", "rest"),
    [("linear8", "linear8", "linear8"), ("palette4", "palette4", "palette4"),
     ("experts=linear4,rest=linear8", "linear4", "linear8"),
     ("rest=palette6,experts=palette4", "palette4", "palette6")],
)  # fmt: skip
def test_core_ml_compression_takes_the_same_per_part_spelling(spelling, experts, rest):
    methods = CoreMLCompression.parse(spelling)
    assert (methods.of("block_expert"), methods.of("router")) == (experts, rest)


@pytest.mark.parametrize(
    ("parse", "spelling", "message"),
    [(Quantization.parse, "int4", "'int4' is no scheme"), (Quantization.parse, "experts=8da4w", "name both parts"),
     (Quantization.parse, "experts=int8,rest=int8,experts=none", "once each"),
     (Quantization.parse, "weights=int8,rest=none", "once each"),
     (Quantization.parse, "experts=fp16,rest=none", "'fp16' is no scheme"),
     (CoreMLCompression.parse, "int4", "'int4' is no method; choose linear8, linear4, palette8"),
     (CoreMLCompression.parse, "experts=linear4", "name both parts, e.g. experts=linear4,rest=linear8")],
)  # fmt: skip
def test_a_misspelt_scheme_is_one_line_naming_the_forms(parse, spelling, message):
    with pytest.raises(UsageError, match=message):
        parse(spelling)


@pytest.mark.parametrize(
    ("model", "fields", "backend", "spelling", "options", "message"),
    [
        ("mobile-vmoe", {}, "onnx", "8da4w", {}, "--quantize 8da4w: executorch only; a onnx bundle takes none or int8"),
        ("mobile-vmoe", {}, "coreml", "experts=8da4w,rest=int8", {}, "executorch only; a coreml bundle"),
        ("mobile-vmoe", {}, "executorch", "experts=8da4w,rest=int8", {"monolithic": True},
         "a monolithic bundle is one"),
        ("vit", {}, "executorch", "experts=int8,rest=none", {}, "a dense bundle is one graph"),
        ("vmoe", {}, "onnx", "experts=int8,rest=none", {}, "a whole bundle is one graph"),
        ("vit", {"width": 48}, "executorch", "8da4w", {},
         "width 48 and MLP hidden width 192 must both be multiples of 32"),
        # Core ML's compression: of the parts --quantize makes int8, blocks of 32 inputs, and on Core ML only
        ("mobile-vmoe", {}, "coreml", "none", {"coreml_compression": "experts=linear4,rest=linear8"},
         "--quantize leaves the experts in fp16; add --quantize int8"),
        # (a part's method left at the default, linear8, names nothing to compress: not refused)
        ("mobile-vmoe", {}, "coreml", "experts=int8,rest=none", {"coreml_compression": "experts=linear4,rest=palette4"},
         "--quantize leaves the rest in fp16; add --quantize int8"),
        ("vit", {}, "coreml", "none", {"coreml_compression": "palette4"}, "leaves every part in fp16"),
        ("mobile-vmoe", {}, "coreml", "int8", {"coreml_compression": "experts=linear4,rest=linear8",
                                               "monolithic": True},
         "a monolithic bundle is one graph; give one method"),
        ("vit", {"width": 48}, "coreml", "int8", {"coreml_compression": "linear4"},
         "--coreml-compression linear4 scales weights in groups of 32 inputs"),
        ("mobile-vmoe", {}, "executorch", "int8", {"coreml_compression": "linear4"}, "applies to Core ML only"),
    ],
)  # fmt: skip
def test_a_scheme_a_backend_or_layout_cannot_take_is_refused_before_anything_is_written(
    model, fields, backend, spelling, options, message, tmp_path
):
    built = tiny_model(model, **fields).eval()  # fields: tiny_model's overrides; options: export_bundle's
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        export_bundle(built, tmp_path / "bundle", backend, quantize=spelling, **options)
    assert not (tmp_path / "bundle").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "role"), [("per-block", "block_expert"), ("expert-paths", "expert")])
def test_8da4w_experts_compute_their_eager_quantized_modules_natively_too_loading_only_the_chosen(
    layout, role, tmp_path, request
):
    """experts=8da4w,rest=int8 on each split: the 8da4w experts share one program (per block, or for all paths), each
    with its own weights file; each expert graph gives what torchao's quantized copy of its module gives in PyTorch;
    the Python runtime and the native runner agree; the runner opens only the router, the shared graphs and the
    experts it picked."""
    from executorch.runtime import Runtime

    from mobile_moe.export.executorch_backend import quantize_8da4w
    from mobile_moe.export.graphs import split_model
    from mobile_moe.export.manifest import read_manifest
    from mobile_moe.export.runtime import load_bundle

    model = tiny_model("mobile-vmoe", pool="mean").eval()
    images = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    out = tmp_path / "bundle"
    manifest = export_bundle(model, out, "executorch", quantize="experts=8da4w,rest=int8", layout=layout,
                             sample_images=images)  # fmt: skip
    assert manifest.precision.startswith("experts 8da4w") and "rest int8" in manifest.precision
    entries = {graph.name: graph for graph in read_manifest(out).graphs}
    experts = [spec for spec in split_model(model, layout=layout).graphs if spec.role == role]
    programs = {entries[spec.name].file for spec in experts}
    assert len(programs) == {"per-block": 2, "expert-paths": 1}[layout]  # a program per family
    assert len({entries[spec.name].weights.file for spec in experts}) == len(experts)  # the weights, one file each
    for spec in experts:
        entry, inputs = entries[spec.name], spec.example_inputs()
        with torch.no_grad():
            want = quantize_8da4w(spec.module)(*inputs)
        program = Runtime.get().load_program(out / entry.file, data_path=str(out / entry.weights.file))
        got = program.load_method("forward").execute(list(inputs))[0]
        # XNNPACK's integer kernels against torchao's float reference of the same quantized weights and per-token
        # activation scales: they round differently (6e-3 of the largest output here), far under a 4-bit step
        torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * float(want.abs().max()))
    bundle = load_bundle(out)
    expected = [bundle.predict(image.numpy()) for image in images]
    if needs_build.args[0]:
        pytest.skip(needs_build.kwargs["reason"])
    from mobile_moe.device_bench.native_runner import run_native
    from mobile_moe.device_bench.round_settings import RoundSettings
    from mobile_moe.device_bench.workload import Workload, write_raw

    report = run_native(request.getfixturevalue("runner"), out, write_raw(Workload(images.numpy(), "t"),
                        tmp_path / "images.f32"), RoundSettings(iterations=1, warmup=0))  # fmt: skip
    assert [row["experts"] for row in report["images"]] == [p.experts for p in expected]
    np.testing.assert_allclose([row["logits"] for row in report["images"]], [p.logits for p in expected], atol=1e-4)
    graphs = read_manifest(out).graphs
    chosen = {e for row in report["images"] for e in row["experts"]}
    picked = {f.file for g in graphs if g.role == role and g.expert in chosen for f in g.files()}
    shared = {f.file for g in graphs if g.role != role for f in g.files()}
    assert set(report["files_opened"]) == shared | picked
