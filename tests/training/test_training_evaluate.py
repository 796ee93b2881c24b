"""evaluate() and collect_predictions() against a direct computation; the evaluate command."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_model

from mobile_moe.app.cli import main
from mobile_moe.data.datasets import open_data
from mobile_moe.formats.confusion import confusion_from_predictions
from mobile_moe.models.registry import make_config
from mobile_moe.training import recipes
from mobile_moe.training.evaluate import collect_predictions, evaluate
from mobile_moe.training.train import train

SYNTHETIC = "synthetic:classes=7,super=4,per_class=20,noise=0.05"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def val_set():
    return open_data(SYNTHETIC, 32).split("val")


def direct(model, dataset, assignment):
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    labels = torch.tensor([dataset[i][1] for i in range(len(dataset))])
    with torch.no_grad():
        output = model.eval()(images)
    return output, labels, torch.tensor(assignment)


@pytest.mark.parametrize("top_k", [1, 2])
def test_evaluate_equals_a_direct_computation(val_set, top_k):
    assignment = [0, 0, 1, 1, 2, 3, 3]
    model = tiny_model("mobile-vmoe", top_k=top_k)
    scores = evaluate(model, val_set, assignment, batch_size=8)
    output, labels, supers = direct(model, val_set, assignment)
    predicted = output.logits.argmax(-1)
    assert scores["images"] == len(labels)
    assert scores["top1"] == pytest.approx((predicted == labels).float().mean().item())
    top5 = output.logits.topk(5, dim=-1).indices
    assert scores["top5"] == pytest.approx((top5 == labels[:, None]).any(-1).float().mean().item())
    routed = output.routing.experts
    assert scores["router_accuracy"] == pytest.approx((routed[:, 0] == supers[labels]).float().mean().item())
    for e in range(4):
        assert scores["expert_load"][e] == pytest.approx((routed == e).any(-1).float().mean().item())
        mine = routed[:, 0] == e
        expected = (predicted[mine] == labels[mine]).float().mean().item() if mine.any() else None
        assert scores["expert_accuracy"][e] == pytest.approx(expected)
    assert sum(scores["expert_load"]) == pytest.approx(top_k)


def test_dense_model_has_no_router_numbers(val_set):
    scores = evaluate(tiny_model("vit"), val_set)
    assert scores["router_accuracy"] is None and "expert_load" not in scores


def test_collect_predictions_are_softmax_probabilities_in_dataset_order(val_set):
    model = tiny_model("vit")
    probs, labels = collect_predictions(model, val_set, batch_size=5)
    output, expected_labels, _ = direct(model, val_set, [0] * 7)
    assert probs.dtype == np.float64 and labels.dtype == np.int64 and probs.shape == (len(val_set), 7)
    np.testing.assert_array_equal(labels, expected_labels.numpy())
    np.testing.assert_allclose(probs, output.logits.softmax(-1).double().numpy(), atol=1e-6)
    # Each of the 7 probabilities is rounded to float32 (relative error 6e-8) before the float64 sum: a row sums to 1
    # within a few float32 ulps, not exactly (1.0000001 on some hosts, where the softmax kernel rounds differently).
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=0, atol=7 * np.finfo(np.float32).eps)
    counts = confusion_from_predictions(probs, labels, hard=True)
    assert counts.sum() == len(labels) and np.trace(counts) == (probs.argmax(1) == labels).sum()


def test_evaluate_command_json_and_confusion(tmp_path, capsys):
    cfg = make_config("mobile-vmoe", depth=3, width=32, num_heads=2, image_size=16, patch_size=4, num_classes=7,
                      num_experts=4, moe_layers=1)  # fmt: skip
    quick = recipes.tiny().replace(epochs=1, batch_size=16, base_batch=16, eval_batch_size=64)
    run_dir = train(cfg, quick, SYNTHETIC, "truth", tmp_path / "run", verbose=False)
    capsys.readouterr()
    confusion = tmp_path / "confusion.npy"
    code = main(
        ["evaluate", str(run_dir), "--data", SYNTHETIC, "--split", "val", "--json", "--confusion", str(confusion)]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["split"] == "val" and 0 <= result["top1"] <= 1 and len(result["expert_load"]) == 4
    counts = np.load(confusion)
    assert counts.dtype == np.int64  # docs/formats.md: a (C, C) int64 count matrix
    assert counts.shape == (7, 7) and np.trace(counts) / counts.sum() == pytest.approx(result["top1"])
    assert main(["evaluate", str(run_dir)]) == 0 and "top-1" in capsys.readouterr().out  # the run's own data, test
    assert main(["evaluate", str(run_dir), "--data", "digits"]) == 2
    assert "run's classes" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path)]) == 2
    capsys.readouterr()
    # The run's own weights as --confusion (here through a link, another path to the same file): refused, untouched.
    weights = (run_dir / "best.pt").read_bytes()
    (tmp_path / "link.pt").symlink_to(run_dir / "best.pt")
    assert main(["evaluate", str(run_dir), "--data", SYNTHETIC, "--confusion", str(tmp_path / "link.pt")]) == 2
    err = capsys.readouterr().err
    assert "which this command reads" in err and len(err.strip().splitlines()) == 1
    assert (run_dir / "best.pt").read_bytes() == weights
