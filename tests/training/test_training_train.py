"""Training runs on tiny models and tiny data: learning beats chance, the run directory, exact resume, bad input."""

from __future__ import annotations

import json
import re
import shutil
import signal
from itertools import islice

import pytest
import torch
from torch import nn

from mobile_moe.app.cli import build_parser, main
from mobile_moe.errors import UsageError
from mobile_moe.formats.superclasses import random_super_classes, unnamed_classes
from mobile_moe.models.registry import make_config
from mobile_moe.training import engine, recipes
from mobile_moe.training import train as train_module
from mobile_moe.training.run_dir import load_run, read_metrics
from mobile_moe.training.train import resume_training, train

pytestmark = pytest.mark.usefixtures("one_thread")


TINY = {"depth": 3, "width": 32, "num_heads": 2, "image_size": 16, "patch_size": 4}
SYNTHETIC = "synthetic:classes=6,super=3,per_class=30,noise=0.05"


def model_config(name: str, num_classes: int, **overrides):
    extra = {"num_experts": 3, "moe_layers": 1} if name == "mobile-vmoe" else {}
    return make_config(name, num_classes=num_classes, **TINY, **{**extra, **overrides})


def quick(**changes) -> recipes.TrainConfig:
    base = dict(epochs=1, batch_size=32, base_batch=32, base_lr=3e-3, warmup_epochs=0.1, eval_batch_size=512)
    return recipes.tiny().replace(**{**base, **changes})


@pytest.mark.parametrize("name", ["vit", "mobile-vmoe"])
def test_one_epoch_on_digits_beats_chance(tmp_path, name):
    super_classes = "random" if name == "mobile-vmoe" else None
    # Mean pooling: a tiny cls-token ViT sits on a plateau for several epochs before it starts learning digits.
    cfg = model_config(name, 10, pool="mean", **({"num_experts": 2} if name == "mobile-vmoe" else {}))
    train(cfg, quick(epochs=2), "digits", super_classes, tmp_path / "run", verbose=False)
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["val_top1"] > 0.25  # chance is 0.10
    if name == "mobile-vmoe":
        assert rows[-1]["router_accuracy"] > 0.5  # chance for 2 super-classes
        assert sum(rows[-1]["expert_load"]) == pytest.approx(1.0)


def test_synthetic_with_its_true_super_classes_beats_chance_and_writes_a_run(tmp_path):
    out = train(model_config("mobile-vmoe", 6), quick(epochs=3), SYNTHETIC, "truth", tmp_path / "run", verbose=False)
    rows = read_metrics(out)
    assert [row["epoch"] for row in rows] == [1, 2, 3]
    assert rows[-1]["val_top1"] > 1 / 6 + 0.15 and rows[-1]["router_accuracy"] > 1 / 3 + 0.15
    for key in ("train_loss", "val_top1", "val_top5", "router_accuracy", "expert_load", "images_per_s", "lr"):
        assert key in rows[-1]
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["name"] == "mobile-vmoe" and config["data"]["image_size"] == 16
    assert config["super_classes"] == {"spec": "truth", "names": ["s0", "s1", "s2"], "assignment": [0, 0, 1, 1, 2, 2]}
    assert config["recipe"]["epochs"] == 3 and len(config["data"]["mean"]) == 3
    run = load_run(out)
    assert not run.model.training and run.checkpoint["epoch"] == max(rows, key=lambda r: r["val_top1"])["epoch"]
    assert run.super_assignment == [0, 0, 1, 1, 2, 2]
    last = load_run(out, "last")
    assert last.checkpoint["epoch"] == 3 and {"optimizer", "scheduler", "rng"} <= set(last.checkpoint)
    # checkpoint.pt commits the whole run: every row (metrics.jsonl is rewritten from it) and the best epoch
    assert last.checkpoint["history"] == rows and last.checkpoint["best_epoch"] == run.checkpoint["epoch"]


def interrupt_at(monkeypatch, stop_epoch: int) -> None:
    real = train_module.train_one_epoch

    def maybe_interrupt(*args, **kwargs):
        if kwargs["epoch"] == stop_epoch:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_one_epoch", maybe_interrupt)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled: waits for the step's end", "eager: at once"])
def test_ctrl_c_in_a_step(tmp_path, monkeypatch, capsys, one_thread, compiled):
    """A --compile'd step is traced by torch, which aborts if a stop unwinds it: the step finishes first. An eager
    step stops at once (DDP's other ranks would wait for it in an all-reduce)."""
    real_forward, real_update, updates = engine.forward_loss, engine.update, []
    monkeypatch.setattr(train_module, "compile_model", lambda module: module)  # the guard, without minutes of tracing

    def forward_then_ctrl_c(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(engine, "forward_loss", forward_then_ctrl_c)
    monkeypatch.setattr(engine, "update", lambda *args: updates.append(real_update(*args)))
    argv = ["train", "--model", "vit", "--size", "2x32", "--patch", "4", "--image-size", "16", "--data", SYNTHETIC,
            "--recipe", "tiny", "--epochs", "1", "--quiet", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(argv + ["--compile"] * compiled) == 130
    assert updates == ([None] if compiled else []) and capsys.readouterr().err.endswith("mobile-moe: interrupted\n")


@pytest.mark.parametrize("pipeline", ["workers", "crop", "device"])
def test_resume_ends_with_exactly_the_weights_of_an_uninterrupted_run(tmp_path, monkeypatch, pipeline):
    """With every random augmentation on (crop, flip, RandAugment, MixUp/CutMix, erasing) and label routing, per image
    in the loader or per batch on the device."""
    cfg = model_config("mobile-vmoe", 6)
    deit = {f: v for f, v in vars(recipes.deit()).items() if f in AUGMENTATION}
    recipe = quick(epochs=3, **deit, route_by="label", input_pipeline=pipeline)
    whole = train(cfg, recipe, SYNTHETIC, "truth", tmp_path / "whole", verbose=False)
    with monkeypatch.context() as patch:
        interrupt_at(patch, stop_epoch=2)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, recipe, SYNTHETIC, "truth", tmp_path / "resumed", verbose=False)
    assert load_run(tmp_path / "resumed", "last").checkpoint["epoch"] == 2
    resume_training(tmp_path / "resumed", verbose=False)
    expected, got = load_run(whole, "last"), load_run(tmp_path / "resumed", "last")
    for key, value in expected.model.state_dict().items():
        assert torch.equal(value, got.model.state_dict()[key]), key
    assert [r["val_top1"] for r in read_metrics(whole)] == [r["val_top1"] for r in read_metrics(tmp_path / "resumed")]


AUGMENTATION = ("crop_scale", "hflip", "randaugment_ops", "mixup_alpha", "cutmix_alpha", "random_erasing")


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    real = engine.losses.training_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        terms = real(*args, **kwargs)
        calls["n"] += 1
        return terms._replace(total=terms.total * float("nan")) if calls["n"] > 5 else terms

    monkeypatch.setattr(engine.losses, "training_loss", poisoned)
    out = tmp_path / "run"
    # 125 training images, batch 32 -> 3 steps per epoch: the 6th step is epoch 2, step 3.
    with pytest.raises(UsageError, match=r"epoch 2, step 3 \(global step 6\).*kept .*checkpoint.pt from epoch 1"):
        train(model_config("vit", 6), quick(epochs=3), SYNTHETIC, None, out, verbose=False)
    assert load_run(out, "last").checkpoint["epoch"] == 1 and len(read_metrics(out)) == 1


@pytest.mark.parametrize(
    "name, super_classes, changes, message",
    [
        ("vit", None, {"batch_size": 500}, "larger than the 125 training images"),
        ("mobile-vmoe", None, {}, "needs --super-classes"),
        ("mobile-vmoe", None, {"router_loss_weight": 0.0, "route_by": "label"}, "--route-by label needs"),
        ("vit", "random", {}, "has no router"),
        ("mobile-vmoe", "random:x", {}, "seed must be an integer"),
        ("mobile-vmoe", "coarse", {}, "provides no super-classes"),
        ("mobile-vmoe", "nothing-like-a-spec", {}, "use FILE.json"),
        ("mobile-vmoe", "missing.json", {}, "does not exist"),
    ],
)
def test_bad_training_input(tmp_path, name, super_classes, changes, message):
    data = SYNTHETIC if super_classes != "coarse" else "digits"
    classes = 6 if data == SYNTHETIC else 10
    with pytest.raises(UsageError, match=message):
        train(model_config(name, classes), quick(**changes), data, super_classes, tmp_path / "run", verbose=False)
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_super_class_file_must_match_the_data_and_the_experts(tmp_path):
    data_classes = [f"s{c // 2}c{c}" for c in range(6)]
    wrong_count = random_super_classes(data_classes, 2)
    wrong_count.save(tmp_path / "two.json")
    with pytest.raises(UsageError, match="2 super-classes for a model with E=3"):
        train(model_config("mobile-vmoe", 6), quick(), SYNTHETIC, str(tmp_path / "two.json"), tmp_path / "a")
    renamed = random_super_classes([*data_classes[:2], "another", *data_classes[3:]], 3)
    renamed.save(tmp_path / "renamed.json")
    with pytest.raises(UsageError, match="class 2 is 'another' there but 's1c2'"):
        train(model_config("mobile-vmoe", 6), quick(), SYNTHETIC, str(tmp_path / "renamed.json"), tmp_path / "b")
    unnamed = random_super_classes(unnamed_classes(6), 3)  # derived from a confusion matrix without names
    unnamed.save(tmp_path / "unnamed.json")
    with pytest.raises(UsageError, match=r"no names .* derive them again with --class-names FILE \(the 6 class names"):
        train(model_config("mobile-vmoe", 6), quick(), SYNTHETIC, str(tmp_path / "unnamed.json"), tmp_path / "b")
    fewer = random_super_classes(data_classes[:5], 3)
    fewer.save(tmp_path / "fewer.json")
    with pytest.raises(UsageError, match="5 classes, but"):
        train(model_config("mobile-vmoe", 6), quick(), SYNTHETIC, str(tmp_path / "fewer.json"), tmp_path / "c")


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "run"
    train(model_config("mobile-vmoe", 6), quick(), SYNTHETIC, "truth", out, verbose=False)
    return out


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"assignment": "010101"}, "super_classes: assignment: Input should be a valid list"),
        ({"assignment": None}, "super_classes: assignment: Input should be a valid list"),
        ({"assignment": [0, 1]}, "assignment has 2 entries for the run's 6 classes"),
        ({"assignment": [10**30] * 6}, "assignment.0"),
        ({"assignment": [7, 0, 1, 2, 0, 1]}, "assignment uses [7], outside 0..2"),
        ({"assignment": [0.5, 0, 1, 2, 0, 1]}, "assignment.0"),
        ({"names": "abc"}, "a list of names"),
        ({"names": ["a", "b\x1b[31m", "c"]}, "control character"),
        ({"spec": 3}, "a spec string"),
        ({"names": ["a", "b", "c", "d"], "assignment": [0, 1, 2, 3, 0, 1]}, "4 super-classes for a model with E=3"),
    ],
)
def test_a_runs_super_class_record_is_checked_as_a_super_class_file(moe_run, tmp_path, change, fragment):
    """config.json's super_classes entry, read back by evaluate, export and resume, follows the super-class file's
    rules for the run's classes: a forged one is refused in one line, not a crash or a silent 0% router accuracy."""
    out = tmp_path / "run"
    shutil.copytree(moe_run, out)
    config = json.loads((out / "config.json").read_text())
    config["super_classes"].update(change)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=r"config\.json is damaged: .*" + re.escape(fragment)):
        load_run(out)


def test_model_classes_must_match_the_data(tmp_path):
    with pytest.raises(UsageError, match="use --num-classes 6"):
        train(model_config("vit", 10), quick(), SYNTHETIC, None, tmp_path / "run")


def test_train_compile_replays_cuda_graphs_on_cuda_unless_told_not_to_and_each_step_says_it_begins(monkeypatch):
    """--compile's step on CUDA is mode="reduce-overhead" (CUDA graphs) by default, the plain compiled step with
    --no-cuda-graphs or off CUDA; a graphed step marks its start for inductor's cudagraph trees and releases the last
    step's gradients first (the CUDA half runs in tests/test_gpu.py)."""
    from mobile_moe.training.cli import overrides

    cfg, cuda, cpu = recipes.tiny(), torch.device("cuda"), torch.device("cpu")
    assert engine.compile_options(cfg, cuda) == {"mode": "reduce-overhead"}
    assert engine.compile_options(cfg, cuda, world_size=2) == {}  # DDP: the plain compiled step
    assert engine.compile_options(cfg.replace(cuda_graphs=False), cuda) == engine.compile_options(cfg, cpu) == {}
    parser, train = build_parser("train"), ["train", "--out", "run", "--compile"]
    assert overrides(parser.parse_args([*train, "--no-cuda-graphs"]))["cuda_graphs"] is False
    assert "cuda_graphs" not in overrides(parser.parse_args(train))
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for graphed in (False, True):
        engine.Optimisation(model, model, optimizer, None, cuda_graphs=graphed).begin_step()
        assert all(p.grad is None for p in model.parameters())
        assert len(marks) == graphed


def test_recipe_overrides_are_type_checked():
    assert recipes.tiny().replace(epochs="3", hflip="true", base_lr="1e-3").epochs == 3
    for bad, message in [({"epochs": "three"}, "expected int"), ({"hflip": "maybe"}, "true or false"),
                         ({"nonsense": 1}, "unknown training option"), ({"route_by": "coin"}, "route_by")]:  # fmt: skip
        with pytest.raises(UsageError, match=message):
            recipes.tiny().replace(**bad)
    assert recipes.deit().lr == pytest.approx(5e-4 * 1024 / 512)
    assert recipes.vit().mixup_alpha == 0 and recipes.deit().mixup_alpha == 0.8


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seed": 10**20}, "seed=100000000000000000000: must be at most 4294967295"),  # torch's seed overflowed
        ({"seed": -(10**20)}, "seed=-100000000000000000000: must be at least -4294967295"),
        ({"eval_batch_size": 10**20}, "must be at most 16777216"),  # DataLoader's islice refused it after an epoch
        ({"warmup_epochs": 1e308}, "warmup_epochs=1e+308: must be at most 1000000"),  # its steps overflowed an int
        ({"randaugment_ops": 10**9}, "randaugment_ops=1000000000: must be at most 64"),  # a billion ops an image
    ],
)
def test_recipe_values_beyond_what_training_can_do_are_refused_before_it_starts(change, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        recipes.tiny().replace(**change)


def test_evaluation_batches_beyond_the_data_are_the_whole_data():
    from mobile_moe.training.evaluate import in_order

    assert [len(images) for images, _ in in_order(torch.utils.data.TensorDataset(torch.zeros(5), torch.zeros(5)),
                                                  10**20)] == [5]  # fmt: skip


def test_cli_trains_refuses_to_overwrite_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "vit", "--size", "3x64", "--patch", "4", "--image-size", "16", "--data", SYNTHETIC,
            "--recipe", "tiny", "--epochs", "1", "--batch-size", "32", "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    assert load_run(out).config["model"]["num_classes"] == 6  # taken from the data
    assert capsys.readouterr().err.splitlines()[-1] == (  # the tiny recipe warms up for 1 epoch: all of this run
        "warning: the run ends after 1 epoch, inside the recipe's warm-up of 1 epoch, so the learning rate never "
        "reached its peak; give --epochs more than 1 or --set warmup_epochs=0.2"
    )
    assert main(argv) == 2 and "already holds a run" in capsys.readouterr().err
    assert main(["train", "--out", str(out), "--resume", "--epochs", "2", "--quiet"]) == 0
    assert "warning" not in capsys.readouterr().err  # said once, by the run that started it
    assert [row["epoch"] for row in read_metrics(out)] == [1, 2]
    assert main(["train", "--out", str(out), "--resume", "--data", "digits"]) == 2
    assert "--data digits differs from the run's" in capsys.readouterr().err
    assert main([*argv, "--epochs", "3", "--resume"]) == 0  # the starting command with --resume appended
    assert [row["epoch"] for row in read_metrics(out)] == [1, 2, 3]
    assert main(["train", "--out", str(tmp_path / "x"), "--model", "vit", "--data", SYNTHETIC, "--set", "x"]) == 2


def test_load_run_refuses_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(UsageError, match="not a run directory"):
        load_run(tmp_path)
    with pytest.raises(UsageError, match="does not exist"):
        load_run(tmp_path / "nowhere")


# --- runs that would teach nothing: refused before, warned during ---------------------------------------------------


def test_one_class_data_is_refused_before_training(tmp_path, capsys):
    from conftest import write_imagefolder

    root = write_imagefolder(tmp_path / "folder", {"train": 4, "val": 4}, ("cat",), (16, 16))
    argv = ["train", "--model", "vit", "--size", "2x32", "--patch", "8", "--image-size", "16", "--recipe", "tiny",
            "--data", f"imagefolder:{root}", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "has one class ('cat')" in err and err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_the_warm_up_warning_comes_before_the_first_step(tmp_path, capsys, monkeypatch):
    def first_epoch_fails(session, epoch):
        raise UsageError("the first epoch failed")

    monkeypatch.setattr(train_module, "_epoch", first_epoch_fails)
    argv = ["train", "--model", "vit", "--size", "2x32", "--patch", "4", "--image-size", "16", "--data", SYNTHETIC,
            "--recipe", "tiny", "--epochs", "1", "--out", str(tmp_path / "run"), "--quiet"]  # fmt: skip
    assert main(argv) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert warning.startswith("warning: the run ends after 1 epoch, inside") and "first epoch failed" in error


@pytest.mark.parametrize(
    "load, top_k, warned",
    [
        ([0.0, 1.0], 1, True),  # every image to expert 1
        ([0.004, 0.996, 0.0], 1, True),
        ([0.5, 0.5, 0.0, 0.0], 2, True),  # k=2 over 4 experts, two of them never chosen
        ([0.2, 0.5, 0.3], 1, False),
        ([1.0, 1.0, 1.0], 2, False),  # a per-token MoE: every image uses every expert
        ([1.0], 1, False),  # one expert: nothing to collapse onto
        (None, 1, False),  # a dense model
    ],
)
def test_a_collapsed_router_is_recognised(load, top_k, warned):
    from mobile_moe.training.routing import collapse_warning

    assert (collapse_warning(load, top_k, epoch=3) is not None) == warned


def test_a_router_sending_every_image_to_one_expert_is_warned_about_once(tmp_path, capsys, monkeypatch):
    real = train_module.evaluate

    def collapsed(*args, **kwargs):
        scores = real(*args, **kwargs)
        return {**scores, "expert_load": [0.0, 0.0, 1.0]}

    monkeypatch.setattr(train_module, "evaluate", collapsed)
    argv = ["train", "--model", "mobile-vmoe", "--size", "2x32", "--patch", "4", "--image-size", "16", "--data",
            SYNTHETIC, "--super-classes", "truth", "--experts", "3", "--moe-layers", "1", "--recipe", "tiny",
            "--epochs", "2", "--out", str(tmp_path / "run"), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "the router sent" in line]
    assert warnings == [
        "warning: epoch 1: the router sent 100.0% of validation images to expert(s) 2 of 3 (expert_load in "
        "metrics.jsonl); the others learn nothing: check the super-classes (`mobile-moe superclass show`), or add a "
        "--balance-loss"
    ]


def test_the_device_pipeline_gives_the_same_batches_with_0_and_2_workers():
    """Every draw comes from (seed, epoch, rank, step), so worker processes change nothing."""
    from mobile_moe.data import inputs
    from mobile_moe.data.batch_augment import StepKey
    from mobile_moe.data.datasets import open_data
    from mobile_moe.training.distributed import Placement

    data, device = open_data(SYNTHETIC, 16), torch.device("cpu")
    batches = []
    for workers in (0, 2):
        cfg = quick(**{f: v for f, v in vars(recipes.deit()).items() if f in AUGMENTATION}, workers=workers)
        split = inputs.training_split(data, cfg.augmentation, "device", device)
        loader, sampler = train_module.make_loader(split, cfg, Placement(0, 1, device), inputs.collate("device"))
        sampler.set_epoch(1)
        to_model = inputs.batches("device", cfg.augmentation, data, device, mixer=None)
        batches.append([to_model.batch(raw, StepKey(0, 1, 0, step)) for step, raw in enumerate(islice(loader, 2))])
    for (images, targets), (again, targets_again) in zip(*batches, strict=True):
        assert torch.equal(images, again) and torch.equal(targets, targets_again)


def test_a_run_records_its_folders_resolved_path_and_resumes_from_the_same_relative_spec(tmp_path, monkeypatch):
    """`--data imagefolder:photos` from one directory: the run records the folder's absolute path, so `evaluate RUN`
    from anywhere else reads that folder and not another one named photos; the same command resumes."""
    from conftest import write_imagefolder

    write_imagefolder(tmp_path / "here" / "photos", {"train": 6, "val": 4}, ("cat", "dog"), (16, 16))
    write_imagefolder(tmp_path / "elsewhere" / "photos", {"val": 4}, ("ant", "bee", "cow"), (16, 16))
    monkeypatch.chdir(tmp_path / "here")
    argv = ["train", "--model", "vit", "--size", "2x32", "--patch", "4", "--image-size", "16", "--recipe", "tiny",
            "--data", "imagefolder:photos", "--batch-size", "4", "--quiet", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main([*argv, "--epochs", "1"]) == 0
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["data"]["spec"]
    assert recorded == f"imagefolder:{tmp_path / 'here' / 'photos'}"
    assert main([*argv, "--epochs", "2", "--resume"]) == 0
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["evaluate", str(tmp_path / "run"), "--split", "val", "--json"]) == 0  # two classes: its own folder
