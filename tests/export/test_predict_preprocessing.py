"""Train/serve skew: `predict` on an image file gives the logits evaluation gives on it.

A tiny run on a tiny imagefolder of 40x48 images (not S x S, not square, so a stretch and ImageNet's resize +
centre crop see different pixels), exported as ONNX: the manifest carries the run's eval resize policy and predict
applies it; a manifest recording a stretch predicts by a stretch; a bad record is refused in one line.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_imagefolder
from PIL import Image

from mobile_moe.app.cli import main
from mobile_moe.data.image_files import UnreadableImage, read_image
from mobile_moe.export.images import load_image
from mobile_moe.export.manifest import MANIFEST
from mobile_moe.export.manifest_schema import InputSpec
from mobile_moe.export.runtime import load_bundle

pytestmark = pytest.mark.export

SIZE = 16  # S; the images are 40 wide and 48 high
CROP = {"policy": "resize-center-crop", "resize_to": 18, "crop_to": SIZE}  # 18 = round(16 * 256 / 224)
MODEL = ["--model", "vit", "--size", "1x64", "--patch", "8", "--image-size", str(SIZE)]


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    return write_imagefolder(tmp_path_factory.mktemp("images"), {"train": 3, "val": 2}, ("a", "b"), (48, 40))


@pytest.fixture(scope="module")
def run_dir(image_root, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "vit"
    argv = ["train", *MODEL, "--data", f"imagefolder:{image_root}", "--recipe", "tiny", "--epochs", "1"]
    assert main([*argv, "--batch-size", "4", "--device", "cpu", "--quiet", "--out", str(out)]) == 0
    return out


def export_onnx(run_dir: Path, out: Path) -> Path:
    assert main(["export", str(run_dir), "--format", "onnx", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def bundle(run_dir, tmp_path_factory) -> Path:
    return export_onnx(run_dir, tmp_path_factory.mktemp("bundles") / "onnx")


def val_item(run_dir: Path, index: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(file, the val split's image tensor, the trained model's eager logits on it): what `evaluate` computes."""
    from mobile_moe.training.run_dir import load_run

    run = load_run(run_dir)
    data = run.open_data()
    raw = data.raw_splits["val"]  # a Subset of torchvision's ImageFolder
    path = raw.dataset.samples[raw.indices[index]][0]
    image = data.split("val")[index][0]
    with torch.no_grad():
        logits = run.model(image[None]).logits[0]
    return path, image, logits


def predicted_logits(bundle: Path, path: str) -> tuple[torch.Tensor, np.ndarray]:
    """(the tensor predict feeds the bundle, the logits it gets) for an image file: predict's own two steps."""
    opened = load_bundle(bundle)
    image = load_image(path, opened.manifest.input)
    return image, opened.predict(image).logits.reshape(-1)


def test_predict_and_an_imagefolder_read_image_files_alike(tmp_path):
    """One decoder: predict's load_image and the imagefolder loader refuse a file with the same one line."""
    rgb = {"shape": [1, 3, SIZE, SIZE], "dtype": "float32", "mean": [0.5] * 3, "std": [0.5] * 3,
           "resize": {"policy": "stretch"}}
    broken, missing = tmp_path / "broken.png", tmp_path / "missing.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n but not an image")
    for path, message in [(broken, "not an image PIL can decode"), (missing, "does not exist"),
                          (tmp_path, "not a regular file")]:  # fmt: skip
        with pytest.raises(UnreadableImage, match=message) as by_predict:
            load_image(path, InputSpec(**rgb))
        with pytest.raises(UnreadableImage) as by_dataset:
            read_image(str(path))
        assert str(by_predict.value) == str(by_dataset.value) and str(path) in str(by_dataset.value)
    Image.new("RGB", (5, 4), (10, 20, 30)).save(tmp_path / "ok.png")
    assert read_image(tmp_path / "ok.png").mode == "RGB" and read_image(tmp_path / "ok.png", "L").mode == "L"
    gray_spec = InputSpec(**{**rgb, "shape": [1, 1, SIZE, SIZE], "mean": [0.5], "std": [0.5]})
    gray = load_image(tmp_path / "ok.png", gray_spec)
    assert gray.shape == (1, SIZE, SIZE)


def test_the_run_and_the_manifest_record_the_eval_resize_policy(run_dir, bundle):
    assert json.loads((run_dir / "config.json").read_text())["data"]["eval_resize"] == CROP
    assert json.loads((bundle / MANIFEST).read_text())["input"]["resize"] == {**CROP, "origin": "run"}


def test_predict_gives_the_logits_evaluation_gives(run_dir, bundle, capsys):
    for index in range(2):
        path, eval_image, eval_logits = val_item(run_dir, index)
        image, logits = predicted_logits(bundle, path)
        assert torch.equal(image, eval_image)  # the same pixels, not merely close ones
        np.testing.assert_allclose(logits, eval_logits.numpy(), rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert main(["predict", str(bundle), path, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)[0]
    assert result["class_index"] == int(eval_logits.argmax())
    assert result["probability"] == pytest.approx(float(eval_logits.softmax(-1).max()), abs=1e-5)


def test_a_manifest_recording_stretch_predicts_by_stretching(run_dir, bundle, tmp_path):
    from torchvision.transforms import v2

    from mobile_moe.training.run_dir import load_run

    manifest = json.loads((bundle / MANIFEST).read_text())
    manifest["input"]["resize"] = {"policy": "stretch", "origin": "assumed"}  # as export writes it without a run
    stretched = tmp_path / "stretched"
    stretched.mkdir()
    for file in bundle.iterdir():
        (stretched / file.name).write_bytes(file.read_bytes())
    (stretched / MANIFEST).write_text(json.dumps(manifest))
    path, cropped, _ = val_item(run_dir, 0)
    # Pillow resizes the file's image (preprocess.eval_transform), then it becomes a tensor
    stretch = v2.Compose([v2.Resize((SIZE, SIZE), antialias=True), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                          v2.Normalize(manifest["input"]["mean"], manifest["input"]["std"])])  # fmt: skip
    expected = stretch(Image.open(path).convert("RGB"))
    image, logits = predicted_logits(stretched, path)
    assert torch.equal(image, expected) and not torch.equal(image, cropped)
    with torch.no_grad():
        eager = load_run(run_dir).model(expected[None]).logits[0].numpy()
    np.testing.assert_allclose(logits, eager, rtol=1e-5, atol=1e-5)


def edit_config(run_dir: Path, to: Path, change) -> Path:
    to.mkdir()
    for file in run_dir.iterdir():
        (to / file.name).write_bytes(file.read_bytes())
    config = json.loads((to / "config.json").read_text())
    change(config["data"])
    (to / "config.json").write_text(json.dumps(config))
    return to


def test_a_run_without_its_resize_record_is_refused_in_one_line(run_dir, tmp_path, capsys):
    """Every run records its eval resize policy; config.json without one is damaged, not exported by a guess."""
    damaged = edit_config(run_dir, tmp_path / "damaged", lambda data: data.pop("eval_resize"))
    capsys.readouterr()
    assert main(["export", str(damaged), "--format", "onnx", "--out", str(tmp_path / "bundle")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{damaged / 'config.json'} is damaged: data.eval_resize is missing" in err, err
    assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize(
    "record, message",
    [
        ({"policy": "fisheye"}, "policy"),
        ({**CROP, "resize_to": 12}, "resize_to 12 is smaller than crop_to 16"),
        ({**CROP, "crop_to": 8, "resize_to": 9}, "crop_to 8 must be the image size 16"),
        ({**CROP, "resize_to": 0}, "greater than or equal to 1"),
        ({"policy": "stretch", "crop_to": 16}, "takes no resize_to or crop_to"),
    ],
)
def test_a_bad_record_in_config_json_is_one_line(run_dir, tmp_path, capsys, record, message):
    broken = edit_config(run_dir, tmp_path / "run", lambda data: data.update(eval_resize=record))
    capsys.readouterr()
    assert main(["export", str(broken), "--format", "onnx", "--out", str(tmp_path / "bundle")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json data.eval_resize" in err and message in err, err
    assert not (tmp_path / "bundle").exists()


def test_pils_warnings_never_reach_stderr_a_bomb_is_one_line_a_palette_is_read(tmp_path, monkeypatch):
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette(list(range(256)) * 3)
    palette.putpixel((1, 1), 1)
    palette.save(tmp_path / "palette.png", transparency=bytes([0, 128] + [255] * 254))  # read back as bytes
    assert isinstance(Image.open(tmp_path / "palette.png").info["transparency"], bytes)  # what PIL warns about
    Image.new("RGB", (12, 12)).save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 144 pixels: over the limit, under twice it (a warning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning would fail the test
        assert read_image(tmp_path / "palette.png").mode == "RGB"
        with pytest.raises(UnreadableImage, match="too large to decode safely"):
            read_image(tmp_path / "big.png")
