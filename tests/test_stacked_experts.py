"""ExpertMLPs' stacked experts: every dispatch computes the same mixture, and checkpoints and runs of the per-expert
layout from before the stack still load and resume exactly. (The grouped GEMM's CUDA kernels, eager and compiled
under bf16 autocast, are checked against the loop in tests/test_gpu.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import backward_with_a_gradient_per_element, spread_clusters, tiny_model

from mobile_moe.errors import UsageError
from mobile_moe.models import moe, token_moe
from mobile_moe.models.checkpoint import checkpoint_dict, load_weights, model_from_checkpoint
from mobile_moe.models.moe import ExpertMLPs, is_stacked, per_expert_key, restacked
from mobile_moe.models.registry import make_config
from mobile_moe.models.vit import Mlp
from mobile_moe.training import recipes
from mobile_moe.training import train as train_module
from mobile_moe.training.optimizer import decays, optimizer_order, restacked_optimizer_state
from mobile_moe.training.run_dir import load_run
from mobile_moe.training.train import resume_training, train

pytestmark = pytest.mark.usefixtures("one_thread")


def experts_and_tokens(num_experts: int = 4) -> tuple[ExpertMLPs, torch.Tensor]:
    torch.manual_seed(0)
    experts = ExpertMLPs(num_experts, 16, 24)
    with torch.no_grad():  # biases start at zero: give them values, so that a bias applied to the wrong rows shows
        experts.fc1_bias.normal_()
        experts.fc2_bias.normal_()
    return experts, torch.randn(7, 5, 16)


def mixture_and_gradients(experts: ExpertMLPs, x, chosen, gates, *, read_sizes: bool) -> dict[str, torch.Tensor]:
    """The mixture and the gradients of a loss with a gradient of its own at every output element."""
    x, gates = x.clone().requires_grad_(), gates.clone().requires_grad_()
    experts.zero_grad()
    mixed = experts.mixture(x, moe.expert_groups(chosen, gates, len(experts), read_sizes=read_sizes))
    backward_with_a_gradient_per_element(mixed)
    stacks = {name: stack.grad.clone() for name, stack in experts.named_parameters()}
    return {"mixture": mixed.detach(), "x": x.grad, "gates": gates.grad} | stacks


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_grouped_gemm_computes_the_loops_mixture_and_gradients_with_an_expert_left_empty(top_k):
    """The grouped GEMM (here torch._grouped_mm's CPU fallback; CUDA's kernels in tests/test_gpu.py) against the loop,
    forward and backward, and the expert no item chose gets gradients of exactly zero on both."""
    experts, x = experts_and_tokens()
    chosen = torch.tensor([[2, 0], [0, 2], [3, 0], [2, 3], [0, 2], [3, 2], [2, 0]])[:, :top_k]  # expert 1: no item
    gates = torch.rand(7, top_k)
    loop = mixture_and_gradients(experts, x, chosen, gates, read_sizes=True)
    gemm = mixture_and_gradients(experts, x, chosen, gates, read_sizes=False)
    for name, expected in loop.items():
        torch.testing.assert_close(gemm[name], expected, msg=name)
        if name.endswith(("weight", "bias")):
            assert gemm[name][1].eq(0).all() and loop[name][1].eq(0).all(), name
    with torch.no_grad():
        assert torch.equal(experts(x, chosen, gates), loop["mixture"])  # the CPU's own dispatch: the loop
        torch.testing.assert_close(experts(x, chosen, gates, dispatch="dense"), loop["mixture"])


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_the_sorted_stream_and_the_reshape_sum_are_each_items_own_mixture(top_k):
    """Grouped once for all blocks: with k = 1 the stream itself is sorted by expert (no gather or scatter in a block);
    with k > 1 each item's k outputs are summed in choice order. Both equal running each item's experts one by one."""
    experts, x = experts_and_tokens()
    chosen = torch.tensor([[2, 0, 3], [0, 2, 3], [3, 0, 2], [2, 3, 0], [0, 2, 3], [3, 2, 0], [2, 0, 3]])[:, :top_k]
    gates = torch.rand(7, top_k)
    groups = experts.groups(x, chosen, gates, sort_stream=True)
    assert groups.stream_sorted == (top_k == 1)
    with torch.no_grad():
        mixed = groups.from_stream(experts.mixture(groups.to_stream(x), groups))
        one_by_one = torch.stack(
            [
                sum(g * experts.run_expert(int(e), item) for e, g in zip(item_experts, item_gates, strict=True))
                for item, item_experts, item_gates in zip(x, chosen, gates, strict=True)
            ]
        )
    torch.testing.assert_close(mixed, one_by_one)
    assert torch.equal(groups.to_stream(torch.arange(7)), groups.order if top_k == 1 else torch.arange(7))
    assert torch.equal(groups.from_stream(groups.to_stream(torch.arange(7))), torch.arange(7))


def test_the_batched_buffers_are_each_expert_on_its_own_rows():
    experts, _ = experts_and_tokens()
    buffers = torch.randn(4, 9, 16)
    with torch.no_grad():
        batched = experts.buffers_forward(buffers)
        one_by_one = torch.stack([experts.expert(e)(buffers[e]) for e in range(4)])
    torch.testing.assert_close(batched, one_by_one)


def test_an_experts_dense_view_is_the_same_arithmetic_on_the_same_memory():
    experts, x = experts_and_tokens()
    view = experts.expert(3)
    assert torch.equal(view(x), experts.run_expert(3, x))  # the very calls: equal to the last bit
    with torch.no_grad():
        experts.fc2_bias[3] += 1.0
    assert torch.equal(view.fc2.bias, experts.fc2_bias[3])  # a view, not a copy


class PerExpertMLPs(torch.nn.Module):
    """ExpertMLPs as it was before the stack: E separate Mlp modules (experts.<e>.fc1.weight, ...)."""

    def __init__(self, num_experts: int, width: int, hidden: int):
        super().__init__()
        self.experts = torch.nn.ModuleList(Mlp(width, hidden) for _ in range(num_experts))


@pytest.mark.parametrize("name", ["mobile-vmoe", "vmoe"])
def test_a_seed_builds_the_weights_it_built_before_the_stack(name, monkeypatch):
    stacked = tiny_model(name).state_dict()
    monkeypatch.setattr(moe, "ExpertMLPs", PerExpertMLPs)
    monkeypatch.setattr(token_moe, "ExpertMLPs", PerExpertMLPs)
    before = restacked(tiny_model(name).state_dict())
    assert list(before) == list(stacked) and all(torch.equal(before[key], stacked[key]) for key in stacked)


def per_expert_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict as the per-expert layouts wrote it, each stack's experts at its place: ExpertMLPs'
    <place>.experts.<e>.fc1.weight (out, in), ...; a Hard MoE's expert_blocks.<e>.<j>.attn.qkv.weight, ... and
    expert_heads.<e>.fc.weight, ... (no dense name holds an underscore: attn_qkv_weight is attn.qkv.weight)."""
    out = {}
    for key, value in state.items():
        if not is_stacked(key):
            out[key] = value
            continue
        place, _, entry = key.rpartition(".")
        for e, tensor in enumerate(value):
            if place.startswith("expert_blocks."):
                old = f"expert_blocks.{e}.{place.split('.')[1]}.{entry.replace('_', '.')}"
            else:
                old = f"expert_heads.{e}" if place == "expert_heads" else f"{place}.experts.{e}"
                old += f".{entry.replace('_', '.')}"
            assert per_expert_key(old) == (key, e), old
            out[old] = tensor.T.contiguous() if tensor.dim() == 2 else tensor.clone()
    return out


def per_expert_optimizer(saved: dict, state: dict[str, torch.Tensor], old_state: dict[str, torch.Tensor]) -> dict:
    """AdamW's state as the per-expert layout indexed it: each expert's moments under its own parameter's index."""
    new_index = {name: i for i, name in enumerate(optimizer_order(list(state.items())))}
    moments = {}
    for index, name in enumerate(optimizer_order(list(old_state.items()))):
        stack, expert = per_expert_key(name) or (name, None)
        entry = saved["state"][new_index[stack]]
        if expert is None:
            moments[index] = entry
            continue
        pick = {key: value[expert] for key, value in entry.items() if key != "step"}
        dense = {key: value.T.contiguous() if value.dim() == 2 else value for key, value in pick.items()}
        moments[index] = {"step": entry["step"], **dense}
    decayed = sum(decays(name, p) for name, p in old_state.items())
    bounds = ((0, decayed), (decayed, len(moments)))
    groups = zip(saved["param_groups"], bounds, strict=True)
    return {"state": moments, "param_groups": [{**group, "params": list(range(*bound))} for group, bound in groups]}


# A model whose per-expert layout came before its stacks -> one key of that layout.
OLD_KEYS = {
    "vmoe": "blocks.2.mlp.experts.experts.3.fc2.bias",  # per-token: the experts of blocks.<i>.mlp.experts
    "hard-moe": "expert_blocks.3.1.attn.qkv.weight",  # whole blocks: expert_blocks.<e>.<j>, expert_heads.<e>
}


@pytest.mark.parametrize("name", OLD_KEYS)
def test_a_checkpoint_of_the_per_expert_layout_loads_into_the_stack(name, images):
    model = tiny_model(name).eval()
    if name == "hard-moe":  # centroids that spread the images over the experts
        spread_clusters(model, images)
        assert len(set(model(images).routing.experts[:, 0].tolist())) == 4
    old = per_expert_layout(model.state_dict())
    assert OLD_KEYS[name] in old and not any(is_stacked(k) for k in old)
    loaded = model_from_checkpoint({**checkpoint_dict(model), "model": old}, "old.pt").eval()
    assert torch.equal(loaded(images).logits, model(images).logits)
    direct = tiny_model(name)
    direct.load_state_dict(per_expert_layout(model.state_dict()))  # torch's own load_state_dict too (a pre-hook)
    assert all(torch.equal(direct.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_run_of_the_per_expert_layout_resumes_exactly_as_the_stacked_run(tmp_path, monkeypatch):
    cfg = make_config("mobile-vmoe", num_classes=6, depth=3, width=32, num_heads=2, image_size=16, patch_size=4,
                      num_experts=3, moe_layers=2)  # fmt: skip
    recipe = recipes.tiny().replace(epochs=2, batch_size=32, base_batch=32, base_lr=3e-3, warmup_epochs=0.1)
    data = "synthetic:classes=6,super=3,per_class=30,noise=0.05"
    whole = train(cfg, recipe, data, "truth", tmp_path / "whole", verbose=False)
    real = train_module.train_one_epoch

    def stop_before_epoch_two(*args, **kwargs):
        if kwargs["epoch"] == 1:  # counted from 0
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_one_epoch", stop_before_epoch_two)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, recipe, data, "truth", tmp_path / "old", verbose=False)
    monkeypatch.undo()
    last = tmp_path / "old" / "checkpoint.pt"
    checkpoint = torch.load(last, weights_only=True)
    old_model = per_expert_layout(checkpoint["model"])
    checkpoint["optimizer"] = per_expert_optimizer(checkpoint["optimizer"], checkpoint["model"], old_model)
    torch.save({**checkpoint, "model": old_model}, last)  # the run as the per-expert layout left it after epoch 1
    assert checkpoint["epoch"] == 1 and len(checkpoint["optimizer"]["state"]) == len(old_model)  # one per parameter
    resume_training(tmp_path / "old", verbose=False)
    expected, got = load_run(whole, "last").model.state_dict(), load_run(tmp_path / "old", "last").model.state_dict()
    assert all(torch.equal(value, got[key]) for key, value in expected.items())


@pytest.mark.parametrize("name", ["mobile-vmoe", "hard-moe"])
def test_an_expert_never_stepped_gets_zero_moments_and_its_stack_keeps_the_others(name):
    """A per-expert checkpoint whose expert 1 never had an image (no AdamW state): the stack's state is the others'
    moments with zeros in expert 1's slice, where it used to be dropped for the whole stack."""
    model = tiny_model(name)
    old = per_expert_layout(model.state_dict())
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    old_params = [(k, v) for k, v in old.items() if (per_expert_key(k) or (k, 0))[0] in trainable]
    moments = {
        index: {"step": torch.tensor(3.0), "exp_avg": torch.full_like(value, index + 1.0),
                "exp_avg_sq": torch.full_like(value, 2.0)}  # fmt: skip
        for index, (name, value) in enumerate((n, dict(old_params)[n]) for n in optimizer_order(old_params))
        if (per_expert_key(name) or (name, 0))[1] != 1  # expert 1 has no state
    }
    groups = [{"weight_decay": 0.05, "params": []}, {"weight_decay": 0.0, "params": []}]
    state = restacked_optimizer_state({"state": moments, "param_groups": groups}, old, model)["state"]
    order = optimizer_order([(n, p) for n, p in model.named_parameters() if p.requires_grad])
    stack = next(name for name in order if name.endswith("fc1_weight"))
    entry = state[order.index(stack)]
    assert entry["exp_avg"].shape == dict(model.named_parameters())[stack].shape
    assert entry["exp_avg"][1].eq(0).all() and entry["exp_avg_sq"][1].eq(0).all()
    assert entry["exp_avg"][0].ne(0).all() and entry["exp_avg"][2].ne(0).all() and entry["step"] == 3.0


def test_the_device_gate_is_decided_when_the_experts_are_placed_not_in_forward(monkeypatch):
    """The grouped GEMM's device gate is one bool set when the experts are built or moved (nn.Module._apply), so a
    compiled forward traces no device query; it is asked again on every move."""
    monkeypatch.setattr(moe, "grouped_gemm_device", lambda index: pytest.fail("a CUDA query for a CPU tensor"))
    experts, x = experts_and_tokens()
    experts.on_grouped_gemm_device = True  # stale: a move must decide again
    experts.to(torch.float64).to(torch.float32)
    assert not experts.on_grouped_gemm_device
    experts(x, torch.zeros(7, 1, dtype=torch.long), torch.ones(7, 1))  # and a forward asks nothing
    model = tiny_model("mobile-vmoe")
    model.to("cpu")
    assert not any(m.on_grouped_gemm_device for m in model.modules() if isinstance(m, ExpertMLPs))


def test_a_key_torch_never_writes_or_both_layouts_of_one_stack_are_refused_not_merged():
    """An expert index with a leading zero, in other digits or past 9 digits is no layout's key (a second spelling of
    an expert would replace it silently; a 5000-digit one overflowed int()); a stack given in both layouts is two
    values for one entry. Each is left for the loader to refuse in one line."""
    for key in ("expert_blocks.01.0.attn.qkv.weight", "expert_blocks.\u0662.0.attn.qkv.weight",
                "moe_blocks.0.mlp.experts.01.fc1.weight", "expert_heads." + "9" * 5000 + ".fc.weight"):  # fmt: skip
        assert per_expert_key(key) is None, key[:40]
    model = tiny_model("hard-moe")
    state = model.state_dict()
    both = {**state, **{k: v for k, v in per_expert_layout(state).items() if k.endswith("attn.qkv.weight")}}
    assert restacked(both).keys() == both.keys()  # nothing merged, nothing dropped
    with pytest.raises(UsageError, match=r"8 unexpected \(e\.g\. expert_blocks\.0\.0\.attn\.qkv\.weight\)"):
        load_weights(model, both, "both.pt")
