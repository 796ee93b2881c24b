"""ExecuTorch families: a split's experts lowered once into one program, each expert's own weights in a .ptd."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model
from executorch_graph import ExecuTorchGraph

from mobile_moe.export.bundle import export_bundle
from mobile_moe.export.graphs import split_model
from mobile_moe.export.manifest import read_manifest, verified_graph_files
from mobile_moe.models.moe import is_stacked

pytestmark = pytest.mark.export

CASES = {  # name -> (model overrides, export options)
    "expert-paths": ({}, {}),
    "per-block": ({}, {"layout": "per-block"}),
    "expert-paths-int8": ({}, {"quantize": "int8"}),
}


def trained_looking(model: torch.nn.Module) -> torch.nn.Module:
    """Every bias a value (fresh ones are all zero: equal weights share one content hash), and experts far enough
    apart that int8 rounding cannot make one look like another."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if is_stacked(name) and "norm" not in name:  # an expert stack's linears: each expert its own values
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
            elif name.endswith("bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model.eval()


# Every case in the slow set: each family export takes 10-25 s on 2 cores (int8's calibration and quantized lowering
# the most), and `make test` has five minutes on the slowest machine. The fast set still lowers an expert-paths
# family in every ExecuTorch bundle it exports (conftest's `bundle`, test_export_bundles.py's), checks those bundles
# against eager PyTorch, and checks that the native runner opens only the shared program and the chosen experts'
# weights files (test_device_bench_native.py).
@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow) for name in sorted(CASES)])
def exported(request, tmp_path_factory):
    overrides, options = CASES[request.param]
    model = trained_looking(tiny_model("mobile-vmoe", pool="mean", **overrides))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    out = tmp_path_factory.mktemp(request.param) / "bundle"
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    manifest = export_bundle(model, out, "executorch", sample_images=images, calibration_images=images, **options)
    return request.param, model, before, out, manifest, options


def test_experts_share_one_program_and_the_disk_holds_it_once(exported):
    _, model, _, out, manifest, options = exported
    experts = [graph for graph in manifest.graphs if graph.role in ("expert", "block_expert")]
    families: dict[str, list] = {}
    for graph in experts:
        families.setdefault(graph.file, []).append(graph)
    # one program per family (expert-paths: one; per-block: one per MoE block), each expert its own weights file
    assert len(families) == len(split_model(model, layout=options.get("layout")).families)
    assert all(len(members) == model.config.num_experts for members in families.values())
    assert len({graph.weights.file for graph in experts}) == len(experts)
    on_disk = sum(path.stat().st_size for path in out.iterdir() if path.name != "manifest.json")
    assert on_disk == manifest.bundle_bytes() == manifest.sizes["total_bytes"]
    assert on_disk < sum(graph.load_bytes for graph in manifest.graphs)  # the program is not copied per expert


def test_each_expert_runs_from_its_weights_file_as_its_eager_module(exported):
    """fp32: each expert's program + weights computes its eager module's outputs. int8 (rounding, ranges calibrated
    over the family): each is nearer its own eager module than any other expert of its family."""
    name, model, _, out, manifest, options = exported
    specs = {spec.name: spec for spec in split_model(model, layout=options.get("layout")).graphs}
    experts = [graph for graph in manifest.graphs if graph.weights is not None]
    for graph in experts:
        inputs = specs[graph.name].example_inputs()
        program, weights = verified_graph_files(out, graph)
        got = ExecuTorchGraph(program, graph, weights=weights)([x.numpy() for x in inputs])
        got = np.concatenate([got[spec.name].ravel() for spec in graph.outputs])
        family = [other for other in experts if other.file == graph.file]
        errors = {other.name: float(np.abs(got - eager(specs[other.name], inputs)).max()) for other in family}
        if name.endswith("int8"):
            assert min(errors, key=errors.get) == graph.name, errors
        else:
            assert errors[graph.name] <= 1e-4 * max(1.0, float(np.abs(got).max())), errors


def eager(spec, inputs) -> np.ndarray:
    with torch.no_grad():
        outputs = spec.module(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return np.concatenate([output.numpy().ravel() for output in outputs])


def test_export_leaves_the_model_untouched(exported):
    _, model, before, *_ = exported
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.slow  # exports every expert alone: in CI's slow set, which keeps `make test` within 5 minutes
def test_a_family_that_cannot_share_exports_each_expert_alone(monkeypatch, tmp_path):
    import mobile_moe.export.executorch_family as family

    def refuse(members, example_inputs, program_path, weight_paths, **_):
        program_path.write_bytes(b"half-written")  # what a failed attempt may leave: the fallback removes it
        raise family.NotShareable("a test says no")

    monkeypatch.setattr(family, "export_executorch_family", refuse)
    model = trained_looking(tiny_model("mobile-vmoe", pool="mean"))
    out = tmp_path / "bundle"
    manifest = export_bundle(model, out, "executorch")
    assert all(graph.weights is None for graph in manifest.graphs)
    files = sorted(path.name for path in out.iterdir())
    assert files == sorted(["manifest.json", *(graph.file for graph in manifest.graphs)])
    assert read_manifest(out).parity["passed"]


@pytest.mark.slow  # an export of its own: in CI's slow set, which keeps `make test` within 5 minutes
def test_a_tampered_weights_file_is_refused_at_open(tmp_path):
    import shutil

    from faults import flip_byte

    from mobile_moe.errors import UsageError
    from mobile_moe.export.runtime import load_bundle

    model = trained_looking(tiny_model("mobile-vmoe", pool="mean"))
    export_bundle(model, tmp_path / "bundle", "executorch")
    broken = shutil.copytree(tmp_path / "bundle", tmp_path / "broken")
    flip_byte(broken / "expert_1.ptd", 100)
    with pytest.raises(UsageError, match="expert_1.ptd does not match the sha256"):
        load_bundle(broken)  # libmobile_moe checks every file of the bundle at open
