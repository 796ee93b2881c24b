"""`mobile-moe import`: timm and torchvision ViT checkpoints (random weights, saved here: nothing is downloaded) become
dense runs whose model computes the source's logits; what does not map is refused in one line, and nothing is
written then."""

from __future__ import annotations

import hashlib
import json
import pickle
import re

import pytest
import torch
from conftest import source_model, tiny_model, write_imagefolder
from PIL import Image
from safetensors.torch import save_file

from mobile_moe.app.cli import main
from mobile_moe.errors import UsageError
from mobile_moe.importers import Source, convert_model, import_vit
from mobile_moe.training.imported import import_run
from mobile_moe.training.run_dir import load_run, read_config
from mobile_moe.utils.class_names import read_class_names

# (source, constructor kwargs): the two models of the issue at their published size, and small ones at 32 px.
FULL_SIZE = [("timm:deit_tiny_patch16_224", {}), ("torchvision:vit_b_32", {})]
SMALL = [
    ("timm:deit_tiny_patch16_224", {"img_size": 32, "num_classes": 4}),
    ("timm:vit_small_patch16_224", {"img_size": 48, "num_classes": 4}),
    # ViT-B/16 is ViT-B/32's converter at another patch size, with 86 M parameters to draw and save: the slow set
    pytest.param("torchvision:vit_b_16", {"image_size": 32, "num_classes": 4}, marks=pytest.mark.slow),
]
CLASSES = ("ant", "bee", "cat", "dog")


def import_cli(*args) -> int:
    return main(["import", *map(str, args)])


def error_of(capsys, *args) -> str:
    assert import_cli(*args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def logits_difference(run_dir, theirs: torch.nn.Module) -> float:
    ours = load_run(run_dir).model
    size = ours.config.image_size
    images = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = theirs(images)
        assert expected.abs().max() > 0.1  # a comparison that can fail: the logits are not all zero
        return float((ours(images).logits - expected).abs().max())


@pytest.mark.parametrize(("source", "kwargs"), FULL_SIZE + SMALL, ids=lambda v: v if isinstance(v, str) else "")
def test_an_imported_run_computes_the_source_models_logits(source, kwargs, tmp_path):
    theirs = source_model(source, **kwargs)
    weights = tmp_path / "weights.pth"
    torch.save(theirs.state_dict(), weights)
    names = ["--class-names", tmp_path / "names.txt"] if "num_classes" in kwargs else []
    (tmp_path / "names.txt").write_text("\n".join(CLASSES) + "\n")
    assert import_cli(source, "--weights", weights, "--out", tmp_path / "run", *names) == 0
    assert logits_difference(tmp_path / "run", theirs) <= 1e-5
    config = read_config(tmp_path / "run")
    assert config["source"]["model"] == source
    assert config["source"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert config["source"]["max_abs_logit_difference"] <= 1e-5
    classes = config["data"]["class_names"]
    if names:
        assert classes == list(CLASSES)
    else:  # a 1000-way head: ImageNet-1k's WordNet ids, its folder names in sorted order
        assert classes[0] == "n01440764" and classes == sorted(set(classes)) and len(classes) == 1000
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["best.pt", "config.json"]


def test_checkpoint_files_as_libraries_and_training_scripts_save_them(tmp_path):
    theirs = source_model("timm:deit_tiny_patch16_224", img_size=32, num_classes=4)
    state = theirs.state_dict()
    save_file(state, tmp_path / "model.safetensors")  # the Hugging Face hub's format
    torch.save({"epoch": 3, "model": {f"module.{k}": v for k, v in state.items()}}, tmp_path / "ddp.pth")  # DDP
    names = tmp_path / "names.json"
    names.write_text(json.dumps(list(CLASSES)))
    for i, file in enumerate(("model.safetensors", "ddp.pth")):
        out = tmp_path / f"run{i}"
        assert import_cli("timm:deit_tiny_patch16_224", "--weights", tmp_path / file, "--out", out,
                          "--class-names", names) == 0  # fmt: skip
        assert logits_difference(out, theirs) <= 1e-5


@pytest.mark.parametrize(
    "kwargs",
    [
        {"no_embed_class": True, "qkv_bias": False},  # DeiT-III / FlexiViT style: a zero class-token row, zero bias
        {"global_pool": "avg", "class_token": False, "fc_norm": False},  # mean pooling
        {"pos_embed": "none"},
    ],
    ids=["no-embed-class-no-qkv-bias", "mean-pool", "no-position-embedding"],
)
def test_timm_variants_that_map_compute_the_same_function(kwargs):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    theirs = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=5, **kwargs)
    imported = convert_model(Source("timm", "custom"), theirs.eval())
    assert imported.max_abs_difference <= 1e-5
    assert imported.config.pool == ("mean" if "class_token" in kwargs else "cls")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_values": 0.1}, "block 0 has layer scale"),
        ({"reg_tokens": 2}, "2 register tokens"),
        ({"pre_norm": True}, "before the blocks"),
        ({"qk_norm": True}, "normalises queries and keys"),
        ({"global_pool": "avg", "class_token": False}, "after pooling (fc_norm)"),
        ({"global_pool": "avg"}, "global_pool 'avg' with a class token"),
        ({"num_classes": 0}, "no classifier head"),
    ],
)
def test_timm_features_our_vit_cannot_express_are_refused_by_name(kwargs, message):
    from timm.models.vision_transformer import VisionTransformer

    theirs = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, **{"num_classes": 5,
                               **kwargs})  # fmt: skip
    with pytest.raises(UsageError, match=re.escape(message)):
        convert_model(Source("timm", "custom"), theirs)


def test_models_that_do_not_map_are_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    def refused(source: str, model: torch.nn.Module, *extra) -> str:
        torch.save(model.state_dict(), tmp_path / "w.pth")
        return error_of(capsys, source, "--weights", tmp_path / "w.pth", "--out", tmp_path / "run", *extra)

    distilled = source_model("timm:deit_tiny_distilled_patch16_224", img_size=32)
    assert "distillation token" in refused("timm:deit_tiny_distilled_patch16_224", distilled)
    assert "not timm's VisionTransformer" in refused("timm:resnet18", source_model("timm:resnet18", num_classes=4))
    small = source_model("timm:deit_small_patch16_224", img_size=32)
    assert "does not fit timm:deit_tiny_patch16_224" in refused("timm:deit_tiny_patch16_224", small)
    assert "timm has no model" in refused("timm:no_such_vit", small)
    assert "not one of torchvision's ViTs" in refused("torchvision:resnet18", small)
    assert "use timm:NAME" in refused("keras:vit", small)
    tiny = source_model("timm:deit_tiny_patch16_224", img_size=32, num_classes=4)
    assert "--class-names" in refused("timm:deit_tiny_patch16_224", tiny)
    (tmp_path / "three.txt").write_text("a\nb\nc\n")
    assert "3 names" in refused("timm:deit_tiny_patch16_224", tiny, "--class-names", tmp_path / "three.txt")
    assert not (tmp_path / "run").exists()


def test_a_missing_or_damaged_weights_file_is_one_clear_line(tmp_path, capsys):
    message = error_of(
        capsys, "timm:deit_tiny_patch16_224", "--weights", tmp_path / "none.pth", "--out", tmp_path / "r"
    )
    assert "no such file" in message and "nothing is downloaded" in message and "huggingface" in message
    message = error_of(capsys, "torchvision:vit_b_32", "--weights", tmp_path / "none.pth", "--out", tmp_path / "r")
    assert "~/.cache/torch/hub/checkpoints" in message
    torch.save(source_model("timm:deit_tiny_patch16_224").state_dict(), tmp_path / "w.pth")
    data = bytearray((tmp_path / "w.pth").read_bytes())
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    (tmp_path / "list.pth").write_bytes(b"")
    torch.save([1, 2], tmp_path / "list.pth")
    for name, expected in (("cut.pth", "cannot read"), ("junk.safetensors", "cannot read"), ("list.pth", "no state")):
        assert expected in error_of(capsys, "timm:deit_tiny_patch16_224", "--weights", tmp_path / name, "--out",
                                    tmp_path / "r")  # fmt: skip
    assert not (tmp_path / "r").exists()
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "mine.txt").write_text("keep")
    assert "not empty" in error_of(capsys, "timm:deit_tiny_patch16_224", "--weights", tmp_path / "w.pth", "--out",
                                   tmp_path / "r")  # fmt: skip
    assert (tmp_path / "r" / "mine.txt").read_text() == "keep"


@pytest.fixture
def imported_run(tmp_path):
    """A 4-class timm DeiT at 32 px imported with the class names of an ImageNet-val-style folder (val only)."""
    root = write_imagefolder(tmp_path / "imagenet", {"val": 6}, CLASSES, (48, 40))
    theirs = source_model("timm:deit_tiny_patch16_224", img_size=32, num_classes=4)
    torch.save(theirs.state_dict(), tmp_path / "w.pth")
    run_dir = tmp_path / "deit"
    assert import_cli("timm:deit_tiny_patch16_224", "--weights", tmp_path / "w.pth", "--out", run_dir,
                      "--class-names", root / "val") == 0  # fmt: skip
    return run_dir, root, theirs


def test_an_imported_run_feeds_images_as_timm_does(imported_run):
    """The run's data pipeline is timm's eval transform for the model (crop_pct 0.9, bicubic, ImageNet mean/std)."""
    from timm.data import create_transform, resolve_model_data_config

    run_dir, root, theirs = imported_run
    resize = read_config(run_dir)["data"]["eval_resize"]
    assert resize == {"policy": "resize-center-crop", "resize_to": 35, "crop_to": 32, "interpolation": "bicubic"}
    timm_config = {**resolve_model_data_config(theirs), "input_size": (3, 32, 32)}
    timms = create_transform(**timm_config)
    ours = load_run(run_dir).open_data(f"imagefolder:{root}").eval_transform()
    image = Image.open(next((root / "val" / "cat").iterdir())).convert("RGB")
    difference = (timms(image) - ours(image)).abs()
    assert difference.mean() < 1e-3 and difference.max() < 0.05  # PIL's and torch's bicubic round differently


def test_super_classes_derive_from_an_imported_run_on_an_imagenet_val_folder(imported_run, tmp_path):
    run_dir, root, _ = imported_run
    out = tmp_path / "super.json"
    assert main(["superclass", "derive", "--run", str(run_dir), "--data", f"imagefolder:{root}",
                 "--num-super-classes", "2", "--out", str(out)]) == 0  # fmt: skip
    derived = json.loads(out.read_text())
    assert derived["class_names"] == list(CLASSES) and sorted(set(derived["assignment"])) == [0, 1]


def test_an_imported_run_is_a_starting_point_not_a_training_run(imported_run, tmp_path, capsys):
    """No data of its own (commands that read images take --data), no training state (no resume), and a val-only
    folder has no train split."""
    run_dir, root, _ = imported_run
    argv = ["superclass", "derive", "--run", str(run_dir), "-E", "2", "--out", str(tmp_path / "s.json")]
    assert main(argv) == 2
    assert "has no data of its own; give --data" in capsys.readouterr().err
    assert main(["train", "--out", str(run_dir), "--resume"]) == 2
    assert "cannot be resumed" in capsys.readouterr().err
    assert main(["evaluate", str(run_dir), "--data", f"imagefolder:{root}", "--split", "train"]) == 2
    assert "has no train split" in capsys.readouterr().err
    assert main(["evaluate", str(run_dir), "--data", "digits"]) == 2
    assert "10 classes (0, 1, 2, ...) that are not the 4 of the run" in capsys.readouterr().err
    config = json.loads((run_dir / "config.json").read_text())
    del config["source"]  # without its source record, a null recipe and data spec are a damaged run config
    (run_dir / "config.json").write_text(json.dumps(config))
    assert main(["evaluate", str(run_dir), "--data", f"imagefolder:{root}"]) == 2
    assert "recipe, data.spec has the wrong type" in capsys.readouterr().err


def test_an_imported_run_exports_with_images_from_data_spec(imported_run, tmp_path, capsys):
    """An imported run has no data of its own: export takes --data (a val-only folder is enough for fp32) and the
    bundle's manifest carries timm's preprocessing, which predict applies."""
    run_dir, root, theirs = imported_run
    bundle = tmp_path / "bundle"
    export = ["export", str(run_dir), "--format", "onnx", "--out", str(bundle)]
    assert main(export) == 2
    assert "give --data SPEC" in capsys.readouterr().err
    assert main([*export, "--data", f"imagefolder:{root}"]) == 0
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["input"]["resize"] == {**read_config(run_dir)["data"]["eval_resize"], "origin": "run"}
    assert manifest["class_names"] == list(CLASSES)
    capsys.readouterr()
    image = next((root / "val" / "dog").iterdir())
    assert main(["predict", str(bundle), str(image), "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)[0]
    tensor = load_run(run_dir).open_data(f"imagefolder:{root}").eval_transform()(Image.open(image).convert("RGB"))
    with torch.no_grad():
        expected = theirs(tensor[None]).softmax(-1)[0]
    assert predicted["class_index"] == int(expected.argmax())
    assert abs(predicted["probability"] - float(expected.max())) < 1e-4


@pytest.mark.filterwarnings("error")  # a warning torch printed would be a second line above the refusal
def test_a_foreign_pickle_is_refused_without_torchs_warnings(tmp_path):
    """A plain pickle (protocol 4) makes torch's weights-only unpickler warn before it fails:
    mobile_moe.models.checkpoint's torch_load keeps the warning out, for run checkpoints and imported weights alike."""
    from mobile_moe.importers import parse_source, read_state_dict
    from mobile_moe.models.checkpoint import load_checkpoint

    path = tmp_path / "w.pt"
    path.write_bytes(pickle.dumps({"x": 1}, protocol=4))
    with pytest.raises(UsageError, match="cannot read checkpoint"):
        load_checkpoint(path)
    with pytest.raises(UsageError, match="cannot read it as a checkpoint"):
        read_state_dict(path, parse_source("timm:deit_tiny_patch16_224"))


def test_weights_holding_nan_are_refused_by_name(tmp_path):
    """A diverged or damaged model would evaluate to chance and fail export's parity without saying why."""
    from mobile_moe.importers import parse_source, read_state_dict
    from mobile_moe.models.checkpoint import checkpoint_dict, load_checkpoint, save_checkpoint

    model = tiny_model("vit")
    state = {key: value.clone() for key, value in model.state_dict().items()}
    state["head.norm.weight"][0] = float("nan")
    torch.save(state, tmp_path / "weights.pt")
    with pytest.raises(UsageError, match="entry 'head.norm.weight': holds values that are not finite"):
        read_state_dict(tmp_path / "weights.pt", parse_source("timm:deit_tiny_patch16_224"))
    save_checkpoint({**checkpoint_dict(model), "model": state}, tmp_path / "run.pt")
    with pytest.raises(UsageError, match="run.pt: weight head.norm.weight holds NaN"):
        load_checkpoint(tmp_path / "run.pt")


def test_odd_checkpoints_and_outs_are_one_line_and_leave_users_files(tmp_path, capsys, monkeypatch):
    """From a red-team of the command: entries that are not weights, a directory as --weights, a symlink as --out,
    and a file written into --out while the import runs (kept, and the import refused)."""
    deit = "timm:deit_tiny_patch16_224"
    state = source_model(deit, img_size=32, num_classes=4).state_dict()
    names = ["--class-names", tmp_path / "names.txt"]
    (tmp_path / "names.txt").write_text("\n".join(CLASSES))
    cases = {
        "key.pth": ({**state, 1: torch.zeros(1)}, "its name is not a string"),
        "nan.pth": ({**state, "head.bias": torch.full((4,), float("nan"))}, "not finite"),
        "sparse.pth": ({**state, "head.bias": state["head.bias"].to_sparse()}, "sparse_coo tensor"),
        "float8.pth": ({**state, "head.weight": state["head.weight"].to(torch.float8_e4m3fn)}, "float8_e4m3fn tensor"),
        "float64.pth": ({**state, "head.bias": state["head.bias"].double()}, "float64 tensor"),
        "integers.pth": ({key: value.round().long() for key, value in state.items()}, "int64 tensor"),
        "meta.pth": ({**state, "head.bias": torch.empty(4, device="meta")}, "meta device"),
    }
    for file, (checkpoint, message) in cases.items():
        torch.save(checkpoint, tmp_path / file)
        assert message in error_of(capsys, deit, "--weights", tmp_path / file, "--out", tmp_path / "run", *names)
    hybrid = source_model("timm:vit_tiny_r_s16_p8_224", img_size=32, num_classes=4)
    torch.save(hybrid.state_dict(), tmp_path / "hybrid.pth")
    assert "hybrid ViT" in error_of(capsys, "timm:vit_tiny_r_s16_p8_224", "--weights", tmp_path / "hybrid.pth",
                                    "--out", tmp_path / "run", *names)  # fmt: skip
    assert "not a regular file" in error_of(capsys, deit, "--weights", tmp_path, "--out", tmp_path / "run", *names)
    torch.save(state, tmp_path / "w.pth")
    for file, text, message in (("blank.json", '["a", " ", "c", "d"]', "class name 2 ('') is blank"),
                                ("twice.txt", "a\nb\na\nd", "class name 'a' appears more than once")):  # fmt: skip
        (tmp_path / file).write_text(text)
        assert message in error_of(capsys, deit, "--weights", tmp_path / "w.pth", "--out", tmp_path / "run",
                                   "--class-names", tmp_path / file)  # fmt: skip
    assert not (tmp_path / "run").exists()
    torch.save(state, tmp_path / "w.pth")
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    link_out = ["--out", tmp_path / "link", *names]
    assert "symbolic link" in error_of(capsys, deit, "--weights", tmp_path / "w.pth", *link_out)
    assert not (tmp_path / "run").exists() and list((tmp_path / "target").iterdir()) == []

    out = tmp_path / "raced"
    out.mkdir()
    real = import_vit

    def import_while_a_user_writes(*args):
        (out / "mine.txt").write_text("keep")
        return real(*args)

    monkeypatch.setattr("mobile_moe.training.imported.import_vit", import_while_a_user_writes)
    with pytest.raises(UsageError, match="no longer empty"):
        import_run(deit, tmp_path / "w.pth", out, str(tmp_path / "names.txt"))
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("text", ["\ufeffcat \n dog\n\n", '\ufeff[" cat", "dog "]'], ids=["lines", "json"])
def test_a_names_file_from_a_windows_editor_gives_the_names_themselves(tmp_path, text):
    path = tmp_path / ("names.json" if text.lstrip("\ufeff").startswith("[") else "names.txt")
    path.write_bytes(text.encode("utf-8"))  # a byte-order mark, then names with spaces around them
    assert read_class_names(path) == ["cat", "dog"]
