"""Hard MoE (Gross et al. 2017): nearest-centroid routing, the split, the frozen gater, and the two-stage training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import backward_with_a_gradient_per_element, one_torch_thread, spread_clusters, tiny_model

from mobile_moe.app.cli import main
from mobile_moe.errors import UsageError
from mobile_moe.models import hard_moe
from mobile_moe.models.checkpoint import load_checkpoint
from mobile_moe.models.registry import make_config
from mobile_moe.models.upcycle import upcycle
from mobile_moe.models.vit import Block, ClassifierHead
from mobile_moe.training import cluster_fit as stage
from mobile_moe.training.init_from import check_init_from, load_dense
from mobile_moe.training.run_dir import load_run, read_config, read_metrics

# --- the model ------------------------------------------------------------------------------------------------------


def fitted(model, images, seed=0):
    """Fit the router on the features of `images` as stage 1 does; -> the fitted estimators and the features."""
    with torch.no_grad():
        features = model.image_features(images).double().numpy()
    fit = stage.fit_clusters(features, model.config.num_experts, model.config.pca_dims, seed)
    pca, kmeans = fit["pca"], fit["kmeans"]
    as_buffer = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731
    model.router.set_clusters(
        None if pca is None else as_buffer(pca.mean_),
        None if pca is None else as_buffer(pca.components_),
        as_buffer(kmeans.cluster_centers_),
    )
    return fit, features


@pytest.fixture
def many_images() -> torch.Tensor:
    return torch.randn(40, 3, 32, 32, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("pca_dims", [8, 0])
@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_routing_is_sklearn_kmeans_predict_on_the_pca_features(many_images, pca_dims, pool):
    model = tiny_model("hard-moe", pca_dims=pca_dims, pool=pool).eval()
    fit, features = fitted(model, many_images)
    expected = fit["kmeans"].predict(fit["projected"] if fit["pca"] is None else fit["pca"].transform(features))
    with torch.no_grad():
        routing = model(many_images).routing
    assert routing.experts[:, 0].tolist() == expected.tolist()
    assert len(set(expected.tolist())) > 1  # the test means something: images spread over experts
    assert torch.equal(routing.probs, F.one_hot(routing.experts[:, 0], 4).float())
    assert torch.equal(routing.gates, torch.ones(40, 1))
    distances = ((torch.as_tensor(fit["projected"]).float()[:, None] - model.router.centroids) ** 2).sum(-1)
    torch.testing.assert_close(routing.logits, -distances, atol=1e-4, rtol=1e-4)


def test_an_unfitted_router_ties_and_picks_the_lowest_index(images):
    routing = tiny_model("hard-moe")(images).routing
    assert routing.experts[:, 0].tolist() == [0] * 6
    assert torch.equal(routing.logits, routing.logits[:, :1].expand(6, 4))  # every centroid 0: all distances tie


def test_clusters_live_in_buffers_not_parameters():
    model = tiny_model("hard-moe")
    buffers = {name for name, _ in model.named_buffers()}
    assert buffers == {
        "router_stage.router.pca_mean",
        "router_stage.router.pca_components",
        "router_stage.router.centroids",
    }
    assert {"router_stage.router.centroids"} == {n for n, _ in tiny_model("hard-moe", pca_dims=0).named_buffers()}
    assert not any(name.startswith("router_stage.router") for name, _ in model.named_parameters())
    with pytest.raises(ValueError, match="expected shape"):
        model.router.set_clusters(torch.zeros(32), torch.zeros(8, 32), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="needs the PCA mean"):
        model.router.set_clusters(None, None, torch.zeros(4, 8))


@pytest.mark.parametrize("shared_head", [False, True])
def test_expert_path_equals_the_model_on_the_images_routed_to_it(many_images, shared_head):
    model = tiny_model("hard-moe", pool="mean", shared_head=shared_head).eval()
    fitted(model, many_images)
    with torch.no_grad():
        whole = model(many_images)
        tokens, routing = model.router_stage(many_images)
        assert torch.equal(routing.experts, whole.routing.experts)
        for e in range(4):
            mine = routing.experts[:, 0] == e
            if mine.any():
                logits = model.expert_path(e)(tokens[mine], routing.gates[mine])
                torch.testing.assert_close(logits, whole.logits[mine], atol=1e-5, rtol=1e-5)
        dense = model(many_images, dispatch="dense").logits
    torch.testing.assert_close(dense, whole.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shared_head", [False, True])
def test_expert_path_holds_only_its_own_expert(shared_head):
    """Its blocks and head are dense modules whose parameters are views of expert 2's slices of the stacks."""
    model = tiny_model("hard-moe", shared_head=shared_head)
    path = model.expert_path(2)
    stages = [*model.expert_blocks, *([] if shared_head else [model.expert_heads])]
    own = [tensor for stage in stages for tensor in stage.expert_tensors(2).values()]
    held = [*(p for block in path.blocks for p in block.parameters()), *([] if shared_head else path.head.parameters())]
    assert [p.data_ptr() for p in held] == [t.data_ptr() for t in own]  # views of expert 2's slices, in order
    assert all(torch.equal(p, t) and p.shape == t.shape for p, t in zip(held, own, strict=True))
    assert (path.head is model.head) == shared_head and (model.head is None) != shared_head
    assert (model.expert_heads is None) == shared_head
    with pytest.raises(IndexError):
        model.expert_path(4)


def test_gate_one_is_exactly_the_dense_blocks_and_the_model_runs_them(many_images):
    """The expert path (GatedBlocks and an ExpertHead over views of the stacks) at gate 1 computes the plain dense
    Block's and ClassifierHead's forward, bit for bit; and the model's loop (functional calls over the stacks' slices)
    computes the path on the images routed to that expert, bit for bit."""
    model = tiny_model("hard-moe", pool="mean").eval()
    fitted(model, many_images)
    with torch.no_grad():
        tokens, routing = model.router_stage(many_images)
        path = model.expert_path(1)
        x = tokens
        for view in path.blocks:
            x = Block(view.norm1, view.attn, view.norm2, view.mlp)(x)
        dense = ClassifierHead.forward(path.head, x)
        assert torch.equal(path(tokens, torch.ones(40, 1)), dense)
        mine = routing.experts[:, 0] == 1
        assert 0 < mine.sum() < 40
        assert torch.equal(model(many_images).logits[mine], path(tokens[mine], routing.gates[mine]))


def logits_and_gradients(model, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """The logits and the gradients of a loss whose gradient differs at every logit."""
    model.zero_grad()
    logits = model(batch).logits
    backward_with_a_gradient_per_element(logits)
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits.detach()} | gradients


@pytest.mark.parametrize(("pool", "shared_head"), [("mean", False), ("cls", False), ("mean", True)])
def test_the_grouped_gemm_path_equals_the_loop_with_an_expert_left_empty(many_images, pool, shared_head, monkeypatch):
    """A grouped-GEMM device's path (gathered norm weights, torch._grouped_mm for qkv, proj, fc1, fc2 and the heads'
    7 classes padded to 8, on the batch sorted once; here torch._grouped_mm's CPU fallback) against the per-expert
    loop, forward and backward: the same logits and gradients, and the expert no image chose gets gradients of exactly
    zero on both. (tests/test_gpu.py runs CUDA's kernels, eager and compiled, under bf16 autocast.)"""
    model = tiny_model("hard-moe", pool=pool, shared_head=shared_head).train()
    fitted(model, many_images)
    with torch.no_grad():  # norms and biases off their (1, 0) start: one applied to another expert's rows would show
        for name, stack in model.named_parameters():
            if name.startswith("expert") and stack.dim() == 2:
                stack.copy_(torch.randn(stack.shape, generator=torch.Generator().manual_seed(len(name))))
        routed = model(many_images).routing.experts[:, 0]
    empty = int(routed[0])
    batch = many_images[routed != empty]  # expert `empty` gets no image
    loop = logits_and_gradients(model, batch)
    ran = []
    monkeypatch.setattr(hard_moe, "grouped_gemm_fits", lambda *args, **kwargs: True)
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *args, **kwargs: ran.append(1) or real(*args, **kwargs))
    grouped = logits_and_gradients(model, batch)
    assert len(ran) == 4 * 2 + (not shared_head)  # qkv, proj, fc1, fc2 in each block; the heads
    assert grouped.keys() == loop.keys()
    for name, expected in loop.items():
        torch.testing.assert_close(grouped[name], expected, rtol=1e-5, atol=1e-5, msg=name)
        if name.startswith("expert_"):  # a stack
            assert grouped[name][empty].eq(0).all() and loop[name][empty].eq(0).all(), name


@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "as-traced"])
def test_the_expert_loop_never_runs_a_stage_on_an_empty_batch(many_images, compiling, monkeypatch):
    """CUDA's attention kernels take no empty batch (scaled_dot_product_attention gave None for a (0, 16, 96) bf16
    batch on an H200, crashing the loop the first time an expert got no image). Here an attention that refuses an
    empty batch, as such a kernel does, and an expert with no image: the loop (eagerly, and as a compiled graph runs it,
    with one row of zeros per expert) gives the dense dispatch's logits and gradients (every expert on every image,
    weighted), and the empty expert's gradient is zero."""
    model = tiny_model("hard-moe", pool="mean").train()
    fitted(model, many_images)
    with torch.no_grad():
        routed = model(many_images).routing.experts[:, 0]
    batch = many_images[routed != int(routed[0])]
    empty = int(routed[0])
    real = F.scaled_dot_product_attention

    def refuses_empty(q, k, v, *args, **kwargs):
        assert q.shape[0] > 0, "attention on an empty batch"
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(hard_moe, "grouped_gemm_fits", lambda *args, **kwargs: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    monkeypatch.setattr(F, "scaled_dot_product_attention", refuses_empty)
    loop = logits_and_gradients(model, batch)
    model.forward = lambda images: type(model).forward(model, images, dispatch="dense")
    dense = logits_and_gradients(model, batch)
    for name, expected in dense.items():
        torch.testing.assert_close(loop[name], expected, rtol=1e-5, atol=1e-5, msg=name)
        if name.startswith("expert_"):
            assert loop[name][empty].eq(0).all(), name


def test_an_upcycled_hard_moe_computes_its_gater(images):
    """Every expert is a copy of the gater's last blocks and head: whatever the routing, the logits are the gater's."""
    gater = tiny_model("vit").eval()
    for shared_head in (False, True):
        model = tiny_model("hard-moe", shared_head=shared_head).eval()
        upcycle(model, gater.state_dict(), "gater")
        spread_clusters(model, images)
        # The same function, but each expert runs on the images routed to it: a smaller batch may take another
        # matmul kernel (host-dependent) and round differently in float32's last bits.
        torch.testing.assert_close(model(images).logits, gater(images).logits, rtol=1e-5, atol=1e-6)
    with pytest.raises(UsageError, match="missing"):
        upcycle(model, {k: v for k, v in gater.state_dict().items() if not k.startswith("head.")}, "gater")


def test_the_trunk_is_frozen_and_only_chosen_experts_get_gradients(many_images):
    model = tiny_model("hard-moe", pool="mean")
    fitted(model, many_images)
    assert not any(p.requires_grad for p in model.router_stage.parameters())
    with torch.no_grad():
        nearest = model(many_images).routing.experts[:, 0]
    batch = many_images[(nearest == 0) | (nearest == 2)]  # a batch that needs experts 0 and 2 only
    out = model(batch)
    F.cross_entropy(out.logits, torch.arange(len(batch)) % 7).backward()
    chosen = set(out.routing.experts[:, 0].tolist())
    assert chosen == {0, 2}
    assert all(p.grad is None for p in model.router_stage.parameters())
    stacks = [*model.expert_blocks.named_parameters(), *model.expert_heads.named_parameters()]
    for name, stack in stacks:  # every stack, expert by expert: a gradient where the expert had images, else zero
        assert stack.grad is not None and stack.grad.shape == stack.shape, name
        assert [bool(stack.grad[e].abs().sum() > 0) for e in range(4)] == [e in chosen for e in range(4)], name


def test_no_label_routing_and_known_dispatch_only(images):
    model = tiny_model("hard-moe")
    with pytest.raises(ValueError, match="no label routing"):
        model(images, route_to=torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match="dispatch"):
        model(images, dispatch="sparse")
    with pytest.raises(UsageError, match="top_k"):
        make_config("hard-moe", top_k=2)
    tokens, routing = model.router_stage(images)
    two_each = routing._replace(experts=routing.experts.repeat(1, 2), gates=routing.gates.repeat(1, 2))
    with pytest.raises(ValueError, match="one expert; this routing chose 2"):  # the sorted slices assume k = 1
        model._experts(list(model.expert_blocks), tokens, two_each, "grouped")


# --- two-stage training ---------------------------------------------------------------------------------------------

SYNTHETIC = "synthetic:classes=6,super=3,per_class=30,noise=0.05"
MODEL = ["--size", "3x64", "--patch", "4", "--image-size", "16", "--pool", "mean"]
RECIPE = ["--recipe", "tiny", "--epochs", "1", "--batch-size", "32", "--quiet"]


@pytest.fixture(scope="module")
def gater(tmp_path_factory):
    """A tiny dense vit trained for one epoch: the gater every Hard MoE here starts from."""
    out = tmp_path_factory.mktemp("gater") / "vit"
    with one_torch_thread():
        assert main(["train", "--model", "vit", *MODEL, "--data", SYNTHETIC, *RECIPE, "--out", str(out)]) == 0
    return out


def hard_moe_argv(gater, out, *extra):
    return ["train", "--model", "hard-moe", "--init-from", str(gater), "--experts", "4", "--moe-layers", "2",
            "--data", SYNTHETIC, *RECIPE, "--out", str(out), *extra]  # fmt: skip


def gater_blocks(gater_state, index):
    return {k.split(".", 2)[2]: v for k, v in gater_state.items() if k.startswith(f"blocks.{index}.")}


@pytest.mark.usefixtures("one_thread")
def test_train_fits_kmeans_on_the_frozen_gater_and_trains_each_expert_on_its_cluster(gater, tmp_path, monkeypatch):
    real_fit = stage.fit_clusters

    def fit_with_an_empty_cluster(*args, **kwargs):
        fit = real_fit(*args, **kwargs)
        fit["kmeans"].cluster_centers_[3] = 1e6  # no image is nearest to it
        return fit

    monkeypatch.setattr(stage, "fit_clusters", fit_with_an_empty_cluster)
    out = tmp_path / "hard"
    assert main(hard_moe_argv(gater, out)) == 0
    config = read_config(out)
    record = config["hard_moe"]
    assert config["init_from"] == str(gater.resolve()) and config["model"]["width"] == 64  # size from the gater
    assert record["images"] == 125 and sum(record["cluster_sizes"]) == 125 and record["empty_clusters"] == [3]

    gater_state = load_checkpoint(gater / "best.pt")["model"]
    model = load_run(out, "last").model
    # The trunk is the gater's, bit for bit, after training.
    for key, value in model.router_stage.embedding.state_dict().items():
        assert torch.equal(value, gater_state[f"embedding.{key}"]), key
    for key, value in gater_blocks(gater_state, 0).items():
        assert torch.equal(model.router_stage.blocks[0].state_dict()[key], value), key
    # Each expert with images learned from them. The empty cluster's expert ran on empty batches (the dispatch never
    # branches on the data): zero gradients, so AdamW only shrank its matrices by its decoupled weight decay, one
    # common factor, and left its biases and norms (no decay) as they were.
    for e, size in enumerate(record["cluster_sizes"]):
        for i in range(2):
            for key, start in gater_blocks(gater_state, i + 1).items():
                now = model.expert_blocks[i].expert(e).state_dict()[key]
                if size == 0 and start.ndim < 2:
                    assert torch.equal(now, start), (e, key)
                elif size == 0:
                    torch.testing.assert_close(now, start * (now.norm() / start.norm()), rtol=1e-5, atol=1e-7)
                    assert now.norm() < start.norm(), (e, key)
        learned = any(not torch.equal(model.expert_blocks[1].expert(e).state_dict()[k], v)
                      for k, v in gater_blocks(gater_state, 2).items() if v.ndim < 2)  # fmt: skip
        assert learned == (size > 0), e

    # The routing is scikit-learn's KMeans.predict on the PCA'd features (refitted here with the run's seed).
    data = load_run(out).open_data()
    features = stage.trunk_features(model, data.split("train"), "cpu", 512)
    fit = real_fit(features, 4, 32, record["seed"])
    fit["kmeans"].cluster_centers_[3] = 1e6
    with torch.no_grad():
        routed = model.router.distances(torch.as_tensor(features, dtype=torch.float32)).argmin(-1)
    assert routed.tolist() == fit["kmeans"].predict(fit["pca"].transform(features)).tolist()
    assert np.bincount(routed.numpy(), minlength=4).tolist() == record["cluster_sizes"]
    assert read_metrics(out)[-1]["expert_load"][3] == 0.0


@pytest.mark.usefixtures("one_thread")
def test_train_evaluate_and_resume(gater, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hard"
    assert main(hard_moe_argv(gater, out, "--model-kwargs", "shared_head=true", "pca_dims=0")) == 0
    before = read_config(out)
    assert before["model"]["shared_head"] is True and before["hard_moe"]["explained_variance"] is None
    capsys.readouterr()
    assert main(["evaluate", str(out), "--data", SYNTHETIC, "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert len(scores["expert_load"]) == 4 and sum(scores["expert_load"]) == pytest.approx(1.0)

    # A resume refits nothing: the clusters come from checkpoint.pt, the record from config.json.
    def refit(*args, **kwargs):
        raise AssertionError("a resume must not refit the clusters")

    monkeypatch.setattr(stage, "prepare_hard_moe", refit)
    centroids = load_run(out, "last").model.router.centroids.clone()
    assert main(hard_moe_argv(gater, out, "--model-kwargs", "shared_head=true", "pca_dims=0", "--resume",
                              "--epochs", "2")) == 0  # fmt: skip
    assert [row["epoch"] for row in read_metrics(out)] == [1, 2]
    assert read_config(out)["hard_moe"] == before["hard_moe"]
    assert torch.equal(load_run(out, "last").model.router.centroids, centroids)
    assert main(["train", "--out", str(out), "--resume", "--init-from", str(tmp_path), "--epochs", "3"]) == 2
    assert "--init-from" in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_init_from_errors_are_one_line(gater, tmp_path, capsys):
    def error(argv) -> str:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        return err

    out = str(tmp_path / "x")
    base = ["--data", SYNTHETIC, *RECIPE, "--out", out]
    assert "--init-from RUN_DIR" in error(["train", "--model", "hard-moe", *MODEL, *base])
    assert "does not fit" in error(["train", "--model", "hard-moe", "--init-from", str(gater), "--size", "4x64", *base])
    assert "does not fit" in error(["train", "--model", "hard-moe", "--init-from", str(gater), "--pool", "cls", *base])
    assert "not a run directory" in error(["train", "--model", "hard-moe", "--init-from", str(tmp_path), *base])
    assert not (tmp_path / "x" / "checkpoint.pt").exists()


def test_a_hard_moe_gater_must_be_a_vit_run(gater, tmp_path):
    (tmp_path / "moe").mkdir()
    config = read_config(gater)
    config["model"] = make_config("mobile-vmoe", "3x64", patch_size=4, image_size=16, num_classes=6).to_dict()
    (tmp_path / "moe" / "config.json").write_text(json.dumps(config))
    hard = make_config("hard-moe", "3x64", patch_size=4, image_size=16, num_classes=6, pool="mean", num_experts=4)
    with pytest.raises(UsageError, match="is a mobile-vmoe run"):
        check_init_from(hard, tmp_path / "moe")
    with pytest.raises(UsageError, match="no best.pt"):
        config["model"] = read_config(gater)["model"]
        (tmp_path / "moe" / "config.json").write_text(json.dumps(config))
        load_dense(tiny_model("hard-moe"), tmp_path / "moe", class_names=config["data"]["class_names"])
