"""ExpertMLPs' stacked experts: every dispatch computes the same mixture, and a state dict of any other layout is
refused. (The grouped GEMM's CUDA kernels, eager and compiled under bf16 autocast, are checked against the loop in
tests/test_gpu.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import backward_with_a_gradient_per_element, tiny_model

from mobile_moe.errors import UsageError
from mobile_moe.models import moe
from mobile_moe.models.checkpoint import checkpoint_dict, load_weights, model_from_checkpoint
from mobile_moe.models.moe import ExpertMLPs, is_stacked

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


def per_expert_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with each stack's experts as separate entries at its place (a Hard MoE's
    expert_blocks.<e>.<j>.attn.qkv.weight, ..., expert_heads.<e>.fc.weight; ExpertMLPs' <place>.experts.<e>.fc1.weight):
    a layout the stacked models do not read."""
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
            out[old] = tensor.T.contiguous() if tensor.dim() == 2 else tensor.clone()
    return out


# A model whose experts are stacks -> an entry of the per-expert layout the refusal names.
PER_EXPERT_ENTRIES = {
    "hard-moe": r"expert_blocks\.0\.0\.norm1\.weight",
    "vmoe": r"blocks\.\d+\.mlp\.experts\.experts\.0\.fc1\.weight",
}


@pytest.mark.parametrize(("name", "message"), PER_EXPERT_ENTRIES.items())
def test_a_state_dict_with_an_entry_per_expert_is_refused_in_one_line_not_stacked(name, message):
    """The experts' weights are stacks; a state dict holding each expert's tensors apart is no checkpoint of a model
    here (the run format has no such layout): refused in one line naming an entry, never stacked silently."""
    model = tiny_model(name)
    old = per_expert_layout(model.state_dict())
    with pytest.raises(UsageError, match=r"\d+ missing \(e\.g\. .*\), \d+ unexpected \(e\.g\. " + message):
        load_weights(model, old, "old.pt")
    with pytest.raises(UsageError, match="old.pt: its weights do not fit"):
        model_from_checkpoint({**checkpoint_dict(model), "model": old}, "old.pt")
