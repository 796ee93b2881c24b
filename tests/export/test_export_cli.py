"""`mobile-moe export` / `mobile-moe predict` end to end from a run directory on `digits`, and every bad input."""

from __future__ import annotations

import errno
import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import built_once, tiny_model
from faults import untrained_run
from PIL import Image

from mobile_moe.app.cli import main
from mobile_moe.errors import UsageError
from mobile_moe.export.bundle import export_bundle
from mobile_moe.export.manifest import MANIFEST
from mobile_moe.export.runtime import load_bundle
from mobile_moe.models.checkpoint import checkpoint_dict, save_checkpoint

pytestmark = pytest.mark.export


def make_run_dir(run, model):
    """An untrained run of `model` on digits, with random super-classes recorded."""
    return untrained_run(run, model, {"spec": "random", "names": ["a", "b"], "assignment": [0, 1] * 5})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny untrained Mobile V-MoE's run directory, one per session (the bundle below is exported from it)."""
    model = tiny_model("mobile-vmoe", num_classes=10, num_experts=2)
    return built_once(tmp_path_factory, "export-cli-run", lambda out: make_run_dir(out, model))


@pytest.fixture(scope="module")
def onnx_bundle(run_dir, tmp_path_factory):
    """Exported once per session (pytest-xdist may run this module's tests on both workers)."""

    def export(out) -> None:
        assert main(["export", str(run_dir), "--format", "onnx", "--out", str(out)]) == 0

    return built_once(tmp_path_factory, "export-cli-onnx", export)


@pytest.fixture
def png(tmp_path):
    path = tmp_path / "digit.png"
    Image.fromarray((np.random.default_rng(0).random((8, 8, 3)) * 255).astype(np.uint8)).save(path)
    return path


def test_export_from_run_dir_records_run_metadata(onnx_bundle, run_dir):
    manifest = json.loads((onnx_bundle / MANIFEST).read_text())
    assert manifest["class_names"] == [str(i) for i in range(10)]
    assert manifest["super_class_names"] == ["a", "b"]
    assert manifest["parity"]["passed"] and manifest["parity"]["images"] == 16
    assert len(manifest["input"]["mean"]) == 3 and manifest["source"] == str(run_dir)


def test_the_runs_test_top1_reaches_the_manifest_and_the_bench_report_named_by_its_split(tmp_path, capsys):
    """A bundle from a run carries the checkpoint's top-1 on the test split, the number `evaluate` prints, and its
    best.pt's validation top-1; bench compares bundles by the test one and names the split in its table and plot."""
    from mobile_moe.device_bench.bench import bench_bundles

    model = tiny_model("vit", num_classes=10)
    run = make_run_dir(tmp_path / "runs", model)
    save_checkpoint(checkpoint_dict(model, epoch=3, best_top1=0.75), run / "best.pt")
    out = tmp_path / "dense"
    assert main(["export", str(run), "--format", "onnx", "--out", str(out)]) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    capsys.readouterr()
    assert main(["evaluate", str(run), "--json"]) == 0
    assert manifest["test_top1"] == json.loads(capsys.readouterr().out)["top1"]
    assert manifest["validation_top1"] == 0.75
    results = bench_bundles([out], tmp_path / "bench", runtime="onnxruntime", iterations=2, warmup=0,
                            log=lambda message: None)  # fmt: skip
    run_record = results["runs"][0]
    assert run_record["accuracy"] == manifest["test_top1"] and run_record["accuracy_split"] == "test"
    report = (tmp_path / "bench" / "report.md").read_text()
    assert f"| {run_record['accuracy']:.1%} (test) |" in report and "top-1: on the test split" in report
    assert (tmp_path / "bench" / "accuracy_vs_flops.png").is_file()


def test_a_bundle_from_before_test_top1_is_compared_by_its_validation_top1_and_says_so(onnx_bundle, tmp_path):
    """Bundles exported before test_top1 fall back to validation_top1, named so; without either, no accuracy."""
    from mobile_moe.device_bench.results import _accuracy
    from mobile_moe.export.manifest import read_manifest

    manifest = read_manifest(onnx_bundle)
    assert _accuracy(manifest.model_copy(update={"test_top1": None, "validation_top1": 0.5})) == {
        "accuracy": 0.5, "accuracy_split": "validation"}  # fmt: skip
    assert _accuracy(manifest.model_copy(update={"test_top1": None, "validation_top1": None}))["accuracy"] is None


def test_predict_json(onnx_bundle, png, capsys):
    capsys.readouterr()
    assert main(["predict", str(onnx_bundle), str(png), str(png), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert len(results) == 2 and results[0] == results[1]
    assert set(results[0]) == {"image", "class_index", "class", "probability", "top", "experts", "gates"}
    assert results[0]["class"] == str(results[0]["class_index"]) and 0 < results[0]["probability"] <= 1
    assert len(results[0]["experts"]) == 1 and results[0]["experts"][0] in (0, 1)


def test_predict_json_gives_the_top_k_classes_and_the_logits_on_request(onnx_bundle, png, capsys):
    """The top-k are the softmax of the bundle's own logits (torch, float64), most probable first; --logits gives
    them all."""
    import torch

    from mobile_moe.export.images import load_image
    from mobile_moe.export.runtime import load_bundle

    bundle = load_bundle(onnx_bundle)
    logits = torch.from_numpy(bundle.predict(load_image(str(png), bundle.manifest.input)).logits).double().reshape(-1)
    expected = torch.softmax(logits, 0).topk(3)
    capsys.readouterr()
    assert main(["predict", str(onnx_bundle), str(png), "--json", "--top-k", "3", "--logits"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert [c["class_index"] for c in record["top"]] == expected.indices.tolist()
    assert [c["probability"] for c in record["top"]] == pytest.approx(expected.values.tolist(), rel=1e-12)
    assert record["top"][0]["class_index"] == record["class_index"] and record["logits"] == logits.tolist()
    assert main(["predict", str(onnx_bundle), str(png), "--json", "--top-k", "1000"]) == 0
    assert len(json.loads(capsys.readouterr().out)[0]["top"]) == len(bundle.manifest.class_names)
    fails(["predict", str(onnx_bundle), str(png), "--top-k", "0"], capsys, "--top-k 0")
    fails(["predict", str(onnx_bundle), str(png), "--logits"], capsys, "add --json")


def test_predict_text(onnx_bundle, png, tmp_path, capsys):
    assert main(["predict", str(onnx_bundle), str(png)]) == 0
    assert "experts" in capsys.readouterr().out
    forged = tmp_path / "a\nforged: 0 (p=1.000).png"  # a file name holding a newline prints escaped: one line
    forged.write_bytes(png.read_bytes())
    assert main(["predict", str(onnx_bundle), str(forged)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(repr(str(forged)))


# --- bad input: one line, exit status 2, nothing left behind --------------------------------------------------------


def fails(argv, capsys, match: str) -> None:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err, err


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_unknown_format_and_not_a_run_dir(run_dir, tmp_path, capsys):
    fails(["export", str(run_dir), "--format", "tflite", "--out", str(tmp_path / "b")], capsys, "invalid choice")
    fails(["export", str(tmp_path), "--format", "onnx", "--out", str(tmp_path / "b")], capsys, "not a run directory")
    with pytest.raises(UsageError, match="unknown format"):
        export_bundle(tiny_model("vit"), tmp_path / "b", "tflite")
    assert leftovers(tmp_path) == []


def test_unsplittable_model_says_why(tmp_path):
    with pytest.raises(UsageError, match="not a mobile-moe model"):
        export_bundle(torch.nn.Linear(3, 3), tmp_path / "b", "onnx")
    with pytest.raises(UsageError, match="needs top_k = 1"):
        export_bundle(tiny_model("mobile-vmoe", top_k=2), tmp_path / "b", "onnx", layout="expert-paths")
    with pytest.raises(UsageError, match="--monolithic does not apply to vmoe .* exports whole"):
        export_bundle(tiny_model("vmoe"), tmp_path / "b", "onnx", monolithic=True)
    with pytest.raises(UsageError, match="per-block does not apply to hard-moe"):
        export_bundle(tiny_model("hard-moe"), tmp_path / "b", "onnx", layout="per-block")
    with pytest.raises(UsageError, match="a dense ViT is always one graph"):
        export_bundle(tiny_model("vit"), tmp_path / "b", "onnx", monolithic=True)
    assert leftovers(tmp_path) == []


def test_per_token_run_exports_whole_and_predicts(tmp_path, png, capsys):
    """A V-MoE run through the CLI: --layout is one line (exit 2); without it the bundle is one whole graph, and
    predict --json reports the experts the image used."""
    (tmp_path / "run").mkdir()
    run = untrained_run(tmp_path / "run", tiny_model("vmoe", num_classes=10), None)  # no super-classes: per token
    out = tmp_path / "bundle"
    export = ["export", str(run), "--format", "onnx", "--out", str(out)]
    fails([*export, "--layout", "expert-paths"], capsys, "exports whole")
    assert not out.exists()
    capsys.readouterr()
    assert main([*export, "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["composition"]["layout"] == "whole" and manifest["routing"] == "token"
    assert [graph["name"] for graph in manifest["graphs"]] == ["whole"] and manifest["parity"]["passed"]
    for flag in (["--cache-experts", "1"], ["--cache-margin", "0.1"]):  # nothing to cache in one whole graph
        fails(["predict", str(out), str(png), *flag], capsys, f"{flag[0]} chooses among expert graphs loaded one")
    assert main(["predict", str(out), str(png), "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["experts"] == sorted(set(result["experts"])) and sum(result["gates"]) == pytest.approx(1.0)


def test_refuses_to_overwrite_a_directory_that_is_not_a_bundle(run_dir, capsys):
    fails(["export", str(run_dir), "--format", "onnx", "--out", str(run_dir)], capsys, "is not a mobile-moe bundle")
    assert (run_dir / "best.pt").is_file()


def test_a_checkpoint_file_given_for_the_run_directory_names_the_directory(run_dir, tmp_path, capsys):
    expected = f"{run_dir / 'best.pt'} is a file, not a run directory; pass the directory that holds it ({run_dir})"
    fails(["export", str(run_dir / "best.pt"), "--format", "onnx", "--out", str(tmp_path / "b")], capsys, expected)


def test_failed_parity_writes_nothing(monkeypatch, tmp_path):
    import mobile_moe.export.bundle as bundle_module

    monkeypatch.setattr(bundle_module, "parity_passed", lambda result: False)
    with pytest.raises(UsageError, match="parity check failed"):
        export_bundle(tiny_model("vit"), tmp_path / "b", "onnx")
    assert leftovers(tmp_path) == []


def test_tampered_truncated_and_escaping_graphs_are_refused(onnx_bundle, tmp_path, png, capsys):
    manifest = json.loads((onnx_bundle / MANIFEST).read_text())
    router = next(g for g in manifest["graphs"] if g["role"] == "router")

    tampered = shutil.copytree(onnx_bundle, tmp_path / "tampered")
    data = bytearray((tampered / router["file"]).read_bytes())
    data[-10] ^= 0xFF
    (tampered / router["file"]).write_bytes(bytes(data))
    fails(["predict", str(tampered), str(png)], capsys, "does not match the sha256")

    truncated = shutil.copytree(onnx_bundle, tmp_path / "truncated")
    expert = truncated / "expert_0.onnx"
    expert.write_bytes(expert.read_bytes()[:100])
    bundle = load_bundle(truncated)  # experts load lazily: the check runs when expert 0 is first chosen
    with pytest.raises(UsageError, match="tampered with or truncated"):
        for _ in range(20):
            bundle.predict(np.random.default_rng(_).standard_normal((3, 32, 32)).astype(np.float32) * 3)

    escaping = shutil.copytree(onnx_bundle, tmp_path / "escaping")
    shutil.copy(onnx_bundle / "expert_1.onnx", tmp_path / "outside.onnx")
    for graph in manifest["graphs"]:
        if graph["name"] == "expert_1":
            graph["file"] = "../outside.onnx"
    (escaping / MANIFEST).write_text(json.dumps(manifest))
    fails(["predict", str(escaping), str(png)], capsys, "outside the bundle")


def test_wrong_image_shape_dtype_and_unreadable_image(onnx_bundle, tmp_path, capsys):
    bundle = load_bundle(onnx_bundle)
    with pytest.raises(UsageError, match="shape"):
        bundle.predict(np.zeros((3, 16, 16), np.float32))
    with pytest.raises(UsageError, match="dtype"):
        bundle.predict(np.zeros((3, 32, 32), np.float64))
    broken = tmp_path / "broken.png"
    broken.write_text("not an image")
    fails(["predict", str(onnx_bundle), str(broken)], capsys, "cannot read")
    fails(["predict", str(onnx_bundle), str(tmp_path / "missing.png")], capsys, "does not exist")
    fails(["predict", str(tmp_path), str(broken)], capsys, "is not a mobile-moe bundle")


def test_a_file_put_into_out_while_the_export_runs_is_kept_and_the_export_refused(tmp_path, monkeypatch):
    from mobile_moe.export import bundle as bundle_module

    out = tmp_path / "bundle"
    real = bundle_module._export_graphs

    def export_while_a_user_writes(*args, **kwargs):
        out.mkdir(exist_ok=True)
        (out / "notes.txt").write_text("mine")
        return real(*args, **kwargs)

    monkeypatch.setattr(bundle_module, "_export_graphs", export_while_a_user_writes)
    with pytest.raises(UsageError, match="not a mobile-moe bundle"):
        export_bundle(tiny_model("vit").eval(), out, "onnx")
    assert [path.name for path in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert [path.name for path in tmp_path.iterdir()] == ["bundle"]  # no temporary left beside it


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_full_disk_inside_the_onnx_exporters_own_writes_is_one_line_and_leaves_nothing(
    tmp_path, monkeypatch, quantize
):
    """torch.onnx.export writes the file itself (ONNXProgram.save; the int8 path also onnx.save and the quantizer):
    the disk filling up there reaches atomic_path as the OSError it is (torch does not wrap it), half a file on disk."""
    from torch.onnx._internal.exporter._onnx_program import ONNXProgram

    def save_onto_a_full_disk(self, destination, **kwargs):
        with open(destination, "wb") as half:
            half.write(b"\x08\x09half a model")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ONNXProgram, "save", save_onto_a_full_disk)
    out = tmp_path / "bundle"
    with pytest.raises(UsageError, match=f"^cannot write .*: {os.strerror(errno.ENOSPC)};"):
        export_bundle(tiny_model("vit").eval(), out, "onnx", quantize=quantize)
    assert leftovers(tmp_path) == []


def test_bench_names_the_runtime_that_runs_a_bundle_another_runtime_cannot(onnx_bundle, tmp_path, capsys):
    assert main(["bench", str(onnx_bundle), "--runtime", "native", "--out", str(tmp_path / "bench")]) == 2
    refused = capsys.readouterr().err
    assert "--runtime native cannot run it: use --runtime onnxruntime, or leave --runtime out" in refused


def test_a_run_whose_config_and_checkpoint_describe_different_models_is_refused(tmp_path, capsys):
    """A best.pt copied in from another run (wider here) used to be evaluated, exported or grown from silently."""
    run = make_run_dir(tmp_path / "run", tiny_model("vit", num_classes=10))
    save_checkpoint(checkpoint_dict(tiny_model("vit", num_classes=10, width=64)), run / "best.pt")
    for argv in (["evaluate", str(run)], ["export", str(run), "--format", "onnx", "--out", str(tmp_path / "b")],
                 ["train", "--model", "mobile-vmoe", "--init-from", str(run), "--data", "digits", "--out",
                  str(tmp_path / "moe"), "--experts", "2", "--super-classes", "random"]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "config.json and best.pt describe different models (width differ); restore the run's" in err, err
    assert not (tmp_path / "b").exists() and not (tmp_path / "moe").exists()
