"""The router loss, the load-balancing loss, label routing and mixed super-class targets, on tiny models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from mobile_moe.data import augment
from mobile_moe.errors import UsageError
from mobile_moe.models.routers import PerImageRouter
from mobile_moe.training import losses
from mobile_moe.training.recipes import TrainConfig
from mobile_moe.training.routing import TrainingForward
from mobile_moe.utils.outputs import Routing

ASSIGNMENT = [0, 0, 1, 1, 2, 3, 3]  # 7 classes (the tiny models' num_classes) -> E = 4 super-classes


def test_loss_is_class_ce_plus_lambda_router_ce(images):
    model = tiny_model("mobile-vmoe")
    labels = torch.tensor([0, 1, 2, 3, 4, 6])
    targets = F.one_hot(labels, 7).float()
    supers = augment.super_targets(targets, augment.assignment_matrix(ASSIGNMENT, 4))
    output = model(images)
    terms = losses.training_loss(output, targets, supers, router_loss_weight=0.3)
    expected_router = F.cross_entropy(output.routing.logits, torch.tensor(ASSIGNMENT)[labels])
    expected = F.cross_entropy(output.logits, labels) + 0.3 * expected_router
    torch.testing.assert_close(terms.total, expected)
    torch.testing.assert_close(terms.router, expected_router.detach())


def test_router_loss_trains_the_router_and_lambda_zero_leaves_it_to_the_gates(images):
    model = tiny_model("mobile-vmoe")
    labels = torch.tensor([0, 1, 2, 3, 4, 6])
    targets = F.one_hot(labels, 7).float()
    supers = augment.super_targets(targets, augment.assignment_matrix(ASSIGNMENT, 4))
    output = model(images)
    with_router = losses.training_loss(output, targets, supers, 0.3)
    grad_with = torch.autograd.grad(with_router.total, model.router.proj.weight, retain_graph=True)[0]
    without = losses.training_loss(output, targets, supers, 0.0)
    assert without.router == 0
    grad_without = torch.autograd.grad(without.total, model.router.proj.weight)[0]
    assert grad_without.abs().sum() > 0  # end-to-end: the gates still carry a gradient to the router
    assert not torch.allclose(grad_with, grad_without)


def test_dense_model_has_no_router_loss(images):
    output = tiny_model("vit")(images)
    targets = F.one_hot(torch.arange(6), 7).float()
    terms = losses.training_loss(output, targets, None, 0.3, balance_loss_weight=0.1)
    torch.testing.assert_close(terms.total, F.cross_entropy(output.logits, torch.arange(6)))


def test_load_balancing_loss_is_one_when_balanced_and_grows_with_collapse():
    uniform = torch.full((4, 4), 0.25)
    balanced = Routing(uniform.log(), uniform, torch.arange(4).view(4, 1), uniform[:, :1])
    assert losses.load_balancing_loss(balanced).item() == pytest.approx(1.0)
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 4)
    collapsed = Routing(probs.log(), probs, torch.zeros(4, 1, dtype=torch.long), probs[:, :1])
    assert losses.load_balancing_loss(collapsed).item() == pytest.approx(4 * 0.7)


def _router_with_probs(probs: torch.Tensor, top_k: int, renormalize: bool = False) -> PerImageRouter:
    """A per-image router whose probabilities are `probs` for every image batch of the same size (mean pooling)."""
    router = PerImageRouter(probs.shape[1], probs.shape[1], top_k, "mean", renormalize)
    router.norm = torch.nn.Identity()
    with torch.no_grad():
        router.proj.weight.copy_(torch.eye(probs.shape[1]))
        router.proj.bias.zero_()
    return router


def _route(probs: torch.Tensor, labels: list[int], top_k: int, renormalize: bool = False):
    tokens = probs.log()[:, None, :]  # (B, 1, E): pooled and projected to log-probs, so softmax gives back `probs`
    return _router_with_probs(probs, top_k, renormalize)(tokens, torch.tensor(labels))


def test_label_routing_k1_sends_each_image_to_its_super_class():
    probs = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])
    forced = _route(probs, [2, 3], top_k=1)
    assert forced.experts.tolist() == [[2], [3]]
    torch.testing.assert_close(forced.gates, torch.tensor([[0.2], [0.1]]))


def test_label_routing_k2_puts_the_true_super_class_first_then_the_routers_best_other():
    probs = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])
    forced = _route(probs, [2, 0], top_k=2)
    assert forced.experts.tolist() == [[2, 1], [0, 1]]
    torch.testing.assert_close(forced.gates, torch.tensor([[0.2, 0.6], [0.4, 0.3]]))
    renormalized = _route(probs, [2, 0], top_k=2, renormalize=True)
    torch.testing.assert_close(renormalized.gates.sum(-1), torch.ones(2))


def test_label_routing_forward_equals_the_model_when_labels_agree_with_the_router(images):
    model = tiny_model("mobile-vmoe", top_k=2).eval()
    with torch.no_grad():
        own = model(images)
        step = TrainingForward(model, route_by="label")
        forced = step(images, own.routing.experts[:, 0])
    torch.testing.assert_close(forced.logits, own.logits)
    torch.testing.assert_close(forced.routing.experts, own.routing.experts)


def test_label_routing_changes_the_experts_used(images):
    model = tiny_model("mobile-vmoe").eval()
    with torch.no_grad():
        own = model(images)
        other = (own.routing.experts[:, 0] + 1) % 4
        forced = TrainingForward(model, route_by="label")(images, other)
    assert forced.routing.experts[:, 0].tolist() == other.tolist()
    assert not torch.allclose(forced.logits, own.logits)


def test_label_routing_needs_a_router():
    with pytest.raises(UsageError, match="per-image router"):
        TrainingForward(tiny_model("vit"), route_by="label")


@pytest.mark.parametrize("mix", ["mixup", "cutmix"])
def test_super_class_targets_are_mixed_like_the_class_targets(mix):
    cfg = TrainConfig(mixup_alpha=0.8 if mix == "mixup" else 0, cutmix_alpha=1.0 if mix == "cutmix" else 0)
    mixer = augment.batch_mixer(cfg.augmentation, num_classes=7)
    labels = torch.tensor([0, 2, 4, 6, 1, 5])
    images = torch.rand(6, 3, 16, 16)
    torch.manual_seed(3)
    mixed_images, targets = augment.class_targets(images, labels, 7, mixer)
    # torchvision mixes each image with its neighbour (labels.roll(1)); recover the weight from row 0.
    lam = targets[0, labels[0]].item()
    assert 0 < lam < 1 and not torch.equal(mixed_images, images)
    assignment = torch.tensor(ASSIGNMENT)
    expected = lam * F.one_hot(assignment[labels], 4) + (1 - lam) * F.one_hot(assignment[labels.roll(1)], 4)
    supers = augment.super_targets(targets, augment.assignment_matrix(ASSIGNMENT, 4))
    torch.testing.assert_close(supers, expected.float())
    torch.testing.assert_close(supers.sum(-1), torch.ones(6))


def test_no_mixing_gives_one_hot_targets():
    assert augment.batch_mixer(TrainConfig(mixup_alpha=0, cutmix_alpha=0).augmentation, 7) is None
    _, targets = augment.class_targets(torch.rand(2, 3, 8, 8), torch.tensor([1, 3]), 7)
    assert targets.argmax(-1).tolist() == [1, 3] and targets.sum().item() == 2
