"""`train --init-from`: sparse upcycling (every expert MLP starts as the dense MLP of its block, routers fresh; with
gates that sum to 1 the upcycled model computes the dense model's function at step 0, from our own dense runs and from
imported timm / torchvision models), a vit's fine-tune, and the transfer to data of other classes (a new classifier,
everything else copied)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import TINY, TINY_OPTIONS, one_torch_thread, spread_clusters, tiny_model

from mobile_moe.app.cli import main
from mobile_moe.errors import UsageError
from mobile_moe.importers import Source, convert_model
from mobile_moe.models.moe import is_stacked, stacked
from mobile_moe.models.registry import MODELS, create_model, make_config
from mobile_moe.models.upcycle import check_dense_fits, upcycle
from mobile_moe.training.run_dir import load_run, read_config

UPCYCLED = sorted(name for name, cfg in MODELS.items() if cfg.upcycle_refusal is None and cfg.routing != "none")
DIGITS_MODEL = ["--size", "3x64", "--patch", "8", "--image-size", "32"]
RECIPE = ["--recipe", "tiny", "--epochs", "1", "--batch-size", "64", "--quiet"]


def upcycled(name: str, dense: torch.nn.Module, **overrides) -> tuple[torch.nn.Module, dict, list[str]]:
    """An MoE `name` of the dense model's size, its fresh state before, and the entries upcycling left fresh."""
    fields = {**TINY, **TINY_OPTIONS[name], "norm_eps": dense.config.norm_eps, **overrides}
    torch.manual_seed(1)
    model = create_model(name, **fields).eval()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    return model, before, upcycle(model, dense.state_dict(), "dense")


@pytest.mark.parametrize("name", UPCYCLED)
def test_every_expert_starts_as_the_dense_mlp_of_its_block_and_routers_start_fresh(name):
    dense = tiny_model("vit")
    model, before, fresh = upcycled(name, dense)
    dense_state, state = dense.state_dict(), model.state_dict()
    assert fresh and all(".router." in key for key in fresh)
    for key, value in state.items():
        source = model.dense_key(key)
        expected = before[key] if source is None else dense_state[source]
        if is_stacked(key):  # a stack (ExpertMLPs, a Hard MoE's blocks and heads): the dense entry once per expert
            expected = stacked([expected] * model.config.num_experts)
        assert torch.equal(value, expected), key
    # Each expert of each MoE block, spelled out: its fc1 is the dense block's.
    first_moe = model.config.depth - model.config.moe_layers
    experts = [(key, weight.T) for key, stack in state.items() if key.endswith("fc1_weight") for weight in stack]
    assert len(experts) == model.config.num_experts * model.config.moe_layers
    for key, weight in experts:
        block = model.dense_key(key).split(".")[1]
        assert int(block) >= first_moe and torch.equal(weight, dense_state[f"blocks.{block}.mlp.fc1.weight"])


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("mobile-vmoe", {"renormalize_gates": True}),  # k = 1: gate 1
        ("mobile-vmoe", {"renormalize_gates": True, "top_k": 2}),  # two identical experts, gates summing to 1
        ("hard-moe", {}),  # one-hot gate
    ],
    ids=["mobile-vmoe-k1", "mobile-vmoe-k2", "hard-moe"],
)
def test_an_upcycled_model_computes_the_dense_function_at_step_zero(name, overrides, images):
    dense = tiny_model("vit").eval()
    model, _, _ = upcycled(name, dense, **overrides)
    if name == "hard-moe":  # any clusters: every expert is the dense tail
        spread_clusters(model, images)
    with torch.no_grad():
        expected = dense(images).logits
        for dispatch in ("grouped", "dense"):
            torch.testing.assert_close(model(images, dispatch=dispatch).logits, expected, atol=1e-6, rtol=0)


def test_without_renormalised_gates_the_upcycled_model_scales_its_experts(images):
    """The paper's gate is the router's winning probability (< 1), so an upcycled Mobile V-MoE starts near, not at,
    the dense function: the issue's exactness claim needs renormalize_gates."""
    dense = tiny_model("vit").eval()
    model, _, _ = upcycled("mobile-vmoe", dense)
    with torch.no_grad():
        assert (model(images).logits - dense(images).logits).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("source", "kwargs", "experts"),
    # ViT-B/32 (88 M parameters) in the slow set: its import is checked in tests/training/test_import.py
    [("timm:deit_tiny_patch16_224", {}, 10), pytest.param("torchvision:vit_b_32", {}, 2, marks=pytest.mark.slow)],
    ids=["deit-tiny", "vit-b-32"],
)
def test_an_upcycled_import_computes_the_source_models_logits(source, kwargs, experts):
    from conftest import source_model

    theirs = source_model(source, **kwargs)
    library, _, name = source.partition(":")
    imported = convert_model(Source(library, name), theirs)
    fields = {k: v for k, v in imported.config.to_dict().items() if k not in ("name", "wide_mlp_layers",
              "wide_mlp_factor")}  # fmt: skip
    torch.manual_seed(0)
    model = create_model("mobile-vmoe", **fields, num_experts=experts, renormalize_gates=True).eval()
    upcycle(model, imported.state_dict, source)
    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = theirs(images)
        assert expected.abs().max() > 0.1 and (model(images).logits - expected).abs().max() <= 1e-5


def test_a_dense_run_that_does_not_fit_is_refused_in_one_line():
    moe = make_config("mobile-vmoe", **TINY, **TINY_OPTIONS["mobile-vmoe"])
    dense = make_config("vit", **TINY).to_dict()
    check_dense_fits(moe, dense, "--init-from d")
    for change, message in (
        ({"width": 64, "num_heads": 2}, "width 32 vs the dense run's 64"),
        ({"norm_eps": 1e-6}, "norm_eps"),
        ({"wide_mlp_layers": 1, "wide_mlp_factor": 2}, "widens its last MLPs"),
        ({"name": "mobile-vmoe"}, "is a mobile-vmoe run"),
    ):
        with pytest.raises(UsageError, match=message):
            check_dense_fits(moe, {**dense, **change}, "--init-from d")
    with pytest.raises(UsageError, match="--init-from starts a model from a dense vit run: widenet's blocks share"):
        check_dense_fits(make_config("widenet", **TINY, **TINY_OPTIONS["widenet"]), dense, "--init-from d")
    check_dense_fits(make_config("vit", **TINY), {**dense, "num_classes": 1000}, "--init-from d")  # other classes
    with pytest.raises(UsageError, match="--model vit with wide_mlp_layers widens"):
        check_dense_fits(make_config("vit", **TINY, wide_mlp_layers=1, wide_mlp_factor=2), dense, "--init-from d")
    with pytest.raises(UsageError, match="blocks.0.mlp.fc1.weight is missing"):
        model = tiny_model("mobile-vmoe")
        upcycle(model, {k: v for k, v in tiny_model("vit").state_dict().items() if "mlp" not in k}, "d")


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dense") / "vit"
    with one_torch_thread():
        assert main(["train", "--model", "vit", *DIGITS_MODEL, "--data", "digits", *RECIPE, "--out", str(out)]) == 0
    return out


@pytest.mark.usefixtures("one_thread")
def test_train_init_from_upcycles_a_dense_run_and_a_resume_keeps_it(dense_run, tmp_path, capsys):
    out = tmp_path / "moe"
    argv = ["train", "--model", "mobile-vmoe", "--init-from", str(dense_run), "--experts", "3", "--data", "digits",
            "--super-classes", "random",
            *RECIPE, "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    config = read_config(out)
    assert config["init_from"] == str(dense_run.resolve())
    assert config["upcycled"]["fresh"] == ["router_stage.router.norm", "router_stage.router.proj"]
    assert config["model"]["depth"] == 3 and config["model"]["patch_size"] == 8  # the dense run's, not flags
    assert main([*argv, "--epochs", "2", "--resume"]) == 0  # the starting command, extended
    assert read_config(out)["upcycled"] == config["upcycled"]
    assert load_run(out, "last").checkpoint["epoch"] == 2  # (best.pt may be epoch 1)
    for field, value in (("norm_eps", 1e-6), ("num_heads", 4), ("mean", "x")):
        edited = tmp_path / f"edited-{field}"
        shutil.copytree(dense_run, edited)
        config = json.loads((edited / "config.json").read_text())
        config["data" if field == "mean" else "model"][field] = value
        (edited / "config.json").write_text(json.dumps(config))
        assert main([*argv[:4], str(edited), *argv[5:-1], str(tmp_path / f"from-{field}")]) == 2
        err = capsys.readouterr().err
        assert ("describe different models" if field != "mean" else "data.mean and data.std") in err, err


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", ["vit", "mobile-vmoe", "hard-moe"])
def test_data_of_other_classes_gets_a_new_classifier_said_once_and_recorded(name, dense_run, tmp_path, capsys):
    """The transfer path: a dense run of 10 digit classes starts a model on 6 synthetic classes; every weight but the
    classifier (head.fc, in each expert's head for a Hard MoE) is the dense run's, and a resume says nothing again."""
    out = tmp_path / name
    options = {"vit": [], "mobile-vmoe": ["--super-classes", "truth", "--experts", "2"], "hard-moe": ["--experts", "2"]}
    data = ["--data", "synthetic:classes=6,super=2,per_class=20"]
    argv = ["train", "--model", name, "--init-from", str(dense_run), *data, *options[name], *RECIPE, "--out", str(out)]
    assert main(argv) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "--init-from" in line]
    copied = {
        "vit": "fine-tuning its weights",
        "mobile-vmoe": "upcycled: every expert MLP starts as the dense MLP of its block, routers fresh",
        "hard-moe": "its weights in the frozen trunk and every expert, k-means routing fitted on its features",
    }
    assert said == [
        f"--init-from {dense_run.resolve()}: {copied[name]}; a new classifier for the data's 6 classes (the dense "
        "run's 10 classes are not the data's); every other weight copied"
    ]
    record = read_config(out)["upcycled" if name != "hard-moe" else "hard_moe"]
    assert record["new_head"] is True and record["dense_classes"] == 10
    model = load_run(out, "last").model
    assert model.config.num_classes == 6
    if name == "vit":  # one epoch moved every weight; the state shows the new classifier's shape, and the rest fit
        dense = load_run(dense_run).model.state_dict()
        assert record["fresh"] == ["head.fc"]
        assert {k: v.shape for k, v in model.state_dict().items() if not k.startswith("head.fc")} == {
            k: v.shape for k, v in dense.items() if not k.startswith("head.fc")
        }
    assert main([*argv, "--epochs", "2", "--resume"]) == 0
    assert "new classifier" not in capsys.readouterr().out


def test_a_vit_fine_tune_copies_every_weight_and_a_transfer_all_but_the_classifier():
    dense = tiny_model("vit")
    torch.manual_seed(3)
    same = create_model("vit", **TINY)
    assert upcycle(same, dense.state_dict(), "dense") == []
    assert all(torch.equal(v, dense.state_dict()[k]) for k, v in same.state_dict().items())
    other = create_model("vit", **{**TINY, "num_classes": 3})
    before = {k: v.clone() for k, v in other.state_dict().items()}
    assert upcycle(other, dense.state_dict(), "dense", new_classes=True) == ["head.fc.weight", "head.fc.bias"]
    for key, value in other.state_dict().items():
        assert torch.equal(value, before[key] if key.startswith("head.fc.") else dense.state_dict()[key]), key


@pytest.mark.usefixtures("one_thread")
def test_a_run_upcycled_from_an_import_sees_images_as_the_source_library_does(tmp_path):
    """The imported model's preprocessing (timm's mean/std, bicubic crop) is the upcycled run's too."""
    from conftest import source_model

    theirs = source_model("timm:deit_tiny_patch16_224", img_size=32, num_classes=10)
    torch.save(theirs.state_dict(), tmp_path / "w.pth")
    (tmp_path / "digits.txt").write_text("\n".join(str(d) for d in range(10)))
    assert main(["import", "timm:deit_tiny_patch16_224", "--weights", str(tmp_path / "w.pth"), "--class-names",
                 str(tmp_path / "digits.txt"), "--out", str(tmp_path / "deit")]) == 0  # fmt: skip
    out = tmp_path / "moe"
    assert main(["train", "--model", "mobile-vmoe", "--init-from", str(tmp_path / "deit"), "--experts", "2",
                 "--moe-layers", "1", "--data", "digits", "--super-classes", "random", *RECIPE, "--out",
                 str(out)]) == 0  # fmt: skip
    imported, trained = read_config(tmp_path / "deit")["data"], read_config(out)["data"]
    assert {k: trained[k] for k in ("mean", "std", "eval_resize")} == {
        k: imported[k] for k in ("mean", "std", "eval_resize")
    }
    assert read_config(out)["upcycled"]["dense_source"] == "timm:deit_tiny_patch16_224"
