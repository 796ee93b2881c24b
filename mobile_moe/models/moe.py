"""The MoE layer: E expert MLPs held as stacked weights, their dispatch, and the MoE-ViT block (shared attention and
norms).

Legend: B routed items (images, for a per-image router), T tokens, D width, F MLP hidden size, E experts, k experts
per item, n_e items routed to expert e (sum over e of n_e = B * k).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mobile_moe.models.config import ViTConfig
from mobile_moe.models.vit import Attention, Block, Mlp, layer_norm
from mobile_moe.utils.outputs import Routing

# The stacked entries of ExpertMLPs -> the dense Mlp entry each expert's slice is (upcycle.block_entry).
STACKED = {
    "fc1_weight": "fc1.weight",
    "fc1_bias": "fc1.bias",
    "fc2_weight": "fc2.weight",
    "fc2_bias": "fc2.bias",
}


def stacked(per_expert: Sequence[Tensor]) -> Tensor:
    """A stacked entry (E, ...) from each expert's dense tensor, in expert order. A Linear weight (2-D, (out, in)) is
    stored transposed, (in, out), as torch._grouped_mm and bmm take it; a 1-D tensor (a bias, a norm's) as it is."""
    return torch.stack([tensor.T if tensor.dim() == 2 else tensor for tensor in per_expert])


def is_stacked(name: str) -> bool:
    """Whether a parameter or state-dict entry of this name holds one tensor per expert (its first dimension): every
    stacked entry is named <layer>_<field>, where a module's own parameters are <layer>.<field>."""
    return name.rpartition(".")[2].endswith(("_weight", "_bias"))


class ExpertGroups(NamedTuple):
    """The routed items of one forward grouped by expert, once, for every MoE block of a per-image MoE.

    order (N,): the (item, choice) pairs, N = B * k, sorted by expert, stably; inverse (N,): its inverse permutation;
    sizes (E,): n_e; host_sizes: the same sizes read on the host once, for the per-expert loop (None for the grouped
    GEMM, which needs no host read); chosen (N,) and gates (N,): each sorted pair's expert and gate; top_k: k.
    stream_sorted: the caller keeps its token stream (B, T, D) in this order for all its blocks (k = 1 only: sorted
    once after the router, unsorted once after the last block), so no block gathers or scatters.
    """

    order: Tensor
    inverse: Tensor
    sizes: Tensor
    host_sizes: list[int] | None
    chosen: Tensor
    gates: Tensor
    top_k: int
    stream_sorted: bool

    def to_stream(self, x: Tensor) -> Tensor:
        """(B, ...) in image order -> the order the MoE blocks run in: sorted by expert where stream_sorted."""
        return x[self.order] if self.stream_sorted else x

    def from_stream(self, x: Tensor) -> Tensor:
        """The inverse of to_stream: (B, ...) back in image order."""
        return x[self.inverse] if self.stream_sorted else x

    def rows(self, x: Tensor) -> Tensor:
        """x (B, T, D) in stream order -> (N, T, D): each (item, choice)'s row, grouped by expert."""
        return x if self.stream_sorted else x[self.order // self.top_k]

    def combined(self, y: Tensor) -> Tensor:
        """y (N, T, D) gated expert outputs grouped by expert -> (B, T, D) in stream order: each item's k outputs
        summed in choice order (a reshape-sum: no zero fill, no atomics, the same sum on every device)."""
        if self.stream_sorted:
            return y
        y = y[self.inverse]  # (B*k, T, D): (item, choice) order
        return y if self.top_k == 1 else y.unflatten(0, (-1, self.top_k)).sum(1)


def expert_groups(
    experts: Tensor, gates: Tensor, num_experts: int, *, read_sizes: bool, sort_stream: bool = False
) -> ExpertGroups:
    """experts and gates (B, k) -> ExpertGroups: one stable sort of the (item, choice) pairs by expert, its inverse, and
    the group sizes, counted into a tensor of static shape (E,) (bincount's shape depends on the data) and read on the
    host where `read_sizes` (the per-expert loop). `sort_stream`: the caller runs its blocks on the sorted stream,
    which k = 1 allows."""
    chosen = experts.reshape(-1)  # (N,)
    order = torch.argsort(chosen, stable=True)  # (N,): pairs grouped by expert
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    sizes = (chosen.unsqueeze(-1) == torch.arange(num_experts, device=chosen.device)).sum(0)  # (E,)
    return ExpertGroups(
        order,
        inverse,
        sizes,
        sizes.tolist() if read_sizes else None,
        chosen[order],
        gates.reshape(-1)[order],
        experts.shape[1],
        sort_stream and experts.shape[1] == 1,
    )


def compile_model(module: Callable, **options) -> Callable:
    """torch.compile(module, **options) for any model of the registry (or a module or function calling one), so
    that the per-expert loop (StackedModules, off CUDA) compiles to one graph: the group sizes it reads on the host are
    traced as unbacked symbolic ints (torch._dynamo.config.capture_scalar_outputs, a process-wide setting that leaves
    other code's graphs as they were unless they read tensors on the host too, which then trace instead of breaking)."""
    torch._dynamo.config.capture_scalar_outputs = True
    return torch.compile(module, **options)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul on `x` runs in: autocast's where autocast is on for x's device, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


@functools.cache
def grouped_gemm_device(index: int) -> bool:
    """Whether CUDA device `index` runs torch._grouped_mm natively and right: Hopper (compute capability 9.0) only,
    asked once per device. On sm100 (B200) pytorch/pytorch issue 172439 (open) gives groups with no rows non-zero
    weight gradients: every unchosen expert would be corrupted, and DDP would all-reduce it to every rank. On sm120
    and ROCm torch falls back to copying the offsets to the host and looping, slower than expert_loop."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index) == (9, 0)


def placed_on_grouped_gemm_device(parameter: Tensor) -> bool:
    """Whether `parameter` lives on a grouped_gemm_device: what StackedModules decide when placed (built or moved),
    so that its forward reads one bool and traces no device query."""
    return parameter.is_cuda and grouped_gemm_device(parameter.device.index)  # a tensor's device has its index


def grouped_gemm_fits(x: Tensor, width: int, hidden: int, *, on_grouped_gemm_device: bool) -> bool:
    """Whether torch._grouped_mm runs this dispatch as one CUTLASS kernel: experts placed on a grouped_gemm_device,
    bf16, rows whose bytes are multiples of 16 (GroupedMMUtils.h, check_valid_strides_and_return_transposed).
    Elsewhere the per-expert loop."""
    return on_grouped_gemm_device and compute_dtype(x) == torch.bfloat16 and width % 8 == 0 and hidden % 8 == 0


def expert_dispatch(device: torch.device, amp: bool) -> str:
    """The dispatch per-image experts (Mobile V-MoE's ExpertMLPs, a Hard MoE's stacked blocks) run training on
    `device` (bf16 autocast where `amp` on CUDA), in words for the run log and the benchmarks."""
    index = device.index if device.index is not None else 0
    if device.type == "cuda" and amp and grouped_gemm_device(index):
        return "grouped GEMM (torch._grouped_mm, sm90, bf16)"
    return "per-expert loop (one matmul per expert and layer)"


def grouped_linear(x: Tensor, weight: Tensor, bias: Tensor, *, groups: ExpertGroups) -> Tensor:
    """x (N, T, in) grouped by expert (groups' rows) -> (N, T, out) in x's dtype: each expert's Linear (stacks weight
    (E, in, out), bias (E, out)) on its rows, as one torch._grouped_mm with the group offsets computed on the device.

    torch._grouped_mm (2D x 3D with offsets) multiplies rows offs[e-1]:offs[e] of its first operand by expert e's
    matrix. Empty groups are allowed there and in its backward's 2D x 2D case, whose operands here are column- and
    row-major (aten/src/ATen/native/cuda/GroupMMCommon.cuh, prepare_grouped_gemm_data: "delta >= 0" for !a_row_major
    && b_row_major). Its rows must be 16-byte multiples (GroupedMMUtils.h): `in` is the model's width or MLP hidden
    size (grouped_gemm_fits); an output size that is not (a head of 10 classes) is padded with zero columns.
    """
    N, T, _ = x.shape
    out = weight.shape[-1]
    offsets = (groups.sizes.cumsum(0) * T).to(torch.int32)  # (E,): the end row of each expert's tokens
    weight = weight.to(x.dtype)
    if out % 8:
        weight = F.pad(weight, (0, -out % 8))  # (E, in, out rounded up to 8)
    y = torch._grouped_mm(x.reshape(N * T, -1), weight, offs=offsets)[:, :out]  # (N*T, out)
    return y.reshape(N, T, out) + bias[groups.chosen].to(x.dtype).unsqueeze(1)


def grouped_mlp(
    x: Tensor, fc1_weight: Tensor, fc1_bias: Tensor, fc2_weight: Tensor, fc2_bias: Tensor, *, groups: ExpertGroups
) -> Tensor:
    """x (N, T, D) grouped by expert -> each expert's MLP (stacked weights) on its rows, ungated: Mlp.forward's
    arithmetic in two grouped_linear calls."""
    hidden = F.gelu(grouped_linear(x, fc1_weight, fc1_bias, groups=groups))  # (N, T, F)
    return grouped_linear(hidden, fc2_weight, fc2_bias, groups=groups)


class StackedModules(nn.Module):
    """E copies of one dense module (an Mlp, a Block, a ClassifierHead) held as stacked Parameters: one per parameter of
    the dense module, named by its path with the dots as underscores (fc1.weight -> fc1_weight, attn.qkv.weight ->
    attn_qkv_weight), each expert's tensor stacked along a first dimension E (`stacked`: Linear weights (in, out)).

    Expert e is the dense module whose parameters are its slices (`expert(e)` hands it out as that module, sharing the
    stacks' memory, so an exported expert graph holds only its own weights). Its subclasses say how the experts run.
    """

    def __init__(self, dense: Sequence[nn.Module]):
        super().__init__()
        if any(True for _ in dense[0].buffers()):
            raise ValueError(f"{type(dense[0]).__name__} has buffers: StackedModules stacks parameters only")
        # The dense names and a weightless copy of the module, to build each expert's view from (not a submodule).
        self.dense_names = {name.replace(".", "_"): name for name, _ in dense[0].named_parameters()}
        self._template = (copy.deepcopy(dense[0]).to("meta"),)
        for entry, name in self.dense_names.items():
            self.register_parameter(entry, nn.Parameter(stacked([m.get_parameter(name).detach() for m in dense])))
        self.on_grouped_gemm_device = placed_on_grouped_gemm_device(next(self.parameters()))

    def _apply(self, fn, recurse: bool = True):
        """nn.Module's own hook for .to(), .cuda() and the like: the device gate is decided here, once per placement."""
        moved = super()._apply(fn, recurse)
        self.on_grouped_gemm_device = placed_on_grouped_gemm_device(next(self.parameters()))
        return moved

    def __len__(self) -> int:
        return next(self.parameters()).shape[0]

    def init_linears(self, init_linear) -> None:
        """init_linear(weight (out, in), bias) on each expert's Linear layers in the dense module's order, expert after
        expert: the order, and so the random draws, of E separate modules in this module's place (vit.init_weights
        calls this). ExpertMLPs draws what the per-expert Mlps drew; a Hard MoE, whose per-expert layout held each
        expert's blocks together, draws its experts block by block now (they start from the gater anyway)."""
        with torch.no_grad():
            for e in range(len(self)):
                for entry in self.dense_names:
                    weight = getattr(self, entry)
                    if weight.dim() == 3:  # a Linear's (E, in, out)
                        dense = weight.new_empty(weight.shape[2], weight.shape[1])  # (out, in): the layout drawn
                        bias = getattr(self, entry.removesuffix("_weight") + "_bias", None)
                        init_linear(dense, None if bias is None else bias[e])
                        weight[e] = dense.T

    def per_expert(self) -> list[dict[str, Tensor]]:
        """Each expert's tensors by their dense names, Linear weights as (out, in) views. One unbind per stack: its
        backward stacks the experts' gradients once, where E separate slices would each add a stack of zeros."""
        slices = {name: getattr(self, entry).unbind(0) for entry, name in self.dense_names.items()}
        return [{name: self._as_dense_layout(tensors[e]) for name, tensors in slices.items()} for e in range(len(self))]

    def experts(self) -> list[Callable[..., Tensor]]:
        """Each expert as a function of the dense module's forward arguments: that forward (torch.func.functional_call
        on a weightless copy of the module) over the expert's per_expert() tensors, so gradients reach the stacks."""
        return [functools.partial(self._run, tensors) for tensors in self.per_expert()]

    def _run(self, tensors: dict[str, Tensor], *args: Tensor) -> Tensor:
        return torch.func.functional_call(self._template[0], tensors, args)

    def expert_tensors(self, expert: int) -> dict[str, Tensor]:
        """Expert `expert`'s tensors as per_expert() gives them, sliced alone (for one expert, not a loop over all)."""
        return {name: self._as_dense_layout(getattr(self, entry)[expert]) for entry, name in self.dense_names.items()}

    @staticmethod
    def _as_dense_layout(piece: Tensor) -> Tensor:
        """A slice of a stack as the dense module holds it: a Linear weight (in, out) back to (out, in), as a view."""
        return piece.T if piece.dim() == 2 else piece

    def expert(self, expert: int) -> nn.Module:
        """Expert `expert` as the dense module whose parameters are views of the stacks: no copy, the same values and
        the same arithmetic, for export and inference. Gradients through it do not reach the stacks."""
        module = copy.deepcopy(self._template[0])  # on the meta device: no memory and no draw for the weights below
        for name, view in self.expert_tensors(expert).items():
            layer, _, field = name.rpartition(".")
            setattr(module.get_submodule(layer), field, nn.Parameter(view.detach(), requires_grad=False))
        return module

    def unstacked(self) -> nn.Module:
        """This module as E dense modules of views (UnstackedModules), for the single-graph export."""
        return UnstackedModules(self)


class UnstackedModules(nn.Module):
    """A StackedModules as E dense modules (`expert(e)`: views of its stacks, no copy), handed out by experts() as
    the modules themselves: what the single-graph export traces. XNNPACK delegates a linear whose weight is a
    parameter of a Linear module's own (its AddmmConfig finds linears by their source module); a linear over a slice
    of a stack, or called outside a Linear module, it leaves to ExecuTorch's portable kernels."""

    def __init__(self, stacked: StackedModules):
        super().__init__()
        self.dense = nn.ModuleList(stacked.expert(e) for e in range(len(stacked)))

    def experts(self) -> list[nn.Module]:
        return list(self.dense)

    def __len__(self) -> int:
        return len(self.dense)


class ExpertMLPs(StackedModules):
    """E MLPs (D -> F -> D, GELU) held as stacked parameters: fc1_weight (E, D, F), fc1_bias (E, F), fc2_weight
    (E, F, D), fc2_bias (E, D). Expert e is the dense Mlp whose Linear weights are fc1_weight[e].T and fc2_weight[e].T;
    `expert(e)` hands it out as that Mlp, sharing the stack's memory, so an exported expert graph holds only its own
    weights."""

    def __init__(self, num_experts: int, width: int, hidden: int):
        # Built from E dense Mlps, each drawn as a dense Mlp is (init_linears then draws in that order too).
        super().__init__([Mlp(width, hidden) for _ in range(num_experts)])
        self.width, self.hidden = width, hidden

    def run_expert(self, expert: int, x: Tensor) -> Tensor:
        """Expert `expert`'s MLP on x (..., D) -> (..., D): the very calls its dense view (`expert(e)`) makes."""
        return self._run(self.expert_tensors(expert), x)

    def unstacked(self) -> nn.Module:
        return UnstackedExperts(self)

    def groups(self, x: Tensor, experts: Tensor, gates: Tensor, *, sort_stream: bool = False) -> ExpertGroups:
        """The items of x (B, T, D) routed to `experts` with `gates` (B, k), grouped for the dispatch this x takes:
        one sort, and for the per-expert loop one host read of the group sizes. sort_stream: see expert_groups."""
        grouped = grouped_gemm_fits(x, self.width, self.hidden, on_grouped_gemm_device=self.on_grouped_gemm_device)
        return expert_groups(experts, gates, len(self), read_sizes=not grouped, sort_stream=sort_stream)

    def forward(
        self, x: Tensor, experts: Tensor, gates: Tensor, dispatch: str = "grouped", groups: ExpertGroups | None = None
    ) -> Tensor:
        """sum over the chosen experts i of g_i * MLP_i(x); x: (B, T, D), experts and gates: (B, k).

        dispatch "grouped" (training, evaluation): O(k) MLP runs per item; "dense": every expert on every item, weighted
        by the sparse gates (dense_mixture), for a single exportable graph that never branches on data. `groups`:
        self.groups(x, experts, gates) when the caller made them already (once for all the blocks of a per-image MoE),
        and then x is in their stream order.
        """
        if dispatch == "dense":
            return dense_mixture(self.experts(), x, experts, gates)
        if dispatch != "grouped":
            raise ValueError(f"dispatch {dispatch!r}: expected 'grouped' or 'dense'")
        return self.mixture(x, groups or self.groups(x, experts, gates))

    def mixture(self, x: Tensor, groups: ExpertGroups) -> Tensor:
        """x (B, T, D) in the groups' stream order -> the gated mixture, in the same order: the per-expert loop where
        the groups read their sizes on the host, else the grouped GEMM."""
        rows = groups.rows(x)  # (N, T, D) grouped by expert
        y = self.expert_loop(rows, groups) if groups.host_sizes is not None else self.grouped_gemm(rows, groups)
        return groups.combined(y * groups.gates.view(-1, 1, 1).to(x.dtype))  # the gate in x's dtype on both paths

    def expert_loop(self, rows: Tensor, groups: ExpertGroups) -> Tensor:
        """rows (N, T, D) grouped by expert -> each expert's MLP on its contiguous rows (N, T, D), ungated.

        One BLAS call per expert and layer: the fastest dispatch on a CPU. The group sizes were read on the host once
        per forward (under compile_model they trace as unbacked symbolic sizes); an expert with no rows runs on an empty
        batch, so compiled graphs need no guard on the data.
        """
        pieces = rows.split(groups.host_sizes)  # each (n_e, T, D)
        return torch.cat([run(rows) for run, rows in zip(self.experts(), pieces, strict=True)])

    def grouped_gemm(self, rows: Tensor, groups: ExpertGroups) -> Tensor:
        """The same as expert_loop in a fixed number of kernels and no host read (grouped_mlp), in autocast's dtype.
        Static shapes, so torch.compile traces it without unbacked sizes."""
        dtype = compute_dtype(rows)
        weights = (self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias)
        return grouped_mlp(rows.to(dtype), *weights, groups=groups).to(rows.dtype)

    def buffers_forward(self, buffers: Tensor) -> Tensor:
        """(E, M, D) -> (E, M, D): expert e on its M buffer rows, all experts as one batched matmul per layer (the
        token-routed models' equal-sized buffers)."""
        hidden = torch.baddbmm(self.fc1_bias.unsqueeze(1), buffers, self.fc1_weight)  # (E, M, F)
        return torch.baddbmm(self.fc2_bias.unsqueeze(1), F.gelu(hidden), self.fc2_weight)


def dense_mixture(experts: Sequence[Callable[[Tensor], Tensor]], x: Tensor, chosen: Tensor, gates: Tensor) -> Tensor:
    """Reference mixture: run all E experts (each x -> MLP_e(x)) on every item and weight by the sparse gate vector.

    Costs E/k times the FLOPs of the grouped dispatch. It exists for tests (the grouped dispatch must equal it) and
    for the naive single-graph export that benchmarks compare against; never use it for training.
    """
    B, E = chosen.shape[0], len(experts)
    weights = gates.new_zeros(B, E).scatter(-1, chosen, gates)  # (B, E), zero off the top-k
    outputs = torch.stack([expert(x) for expert in experts], dim=1)  # (B, E, T, D)
    return torch.einsum("be,betd->btd", weights.to(x.dtype), outputs)  # (B, T, D)


class UnstackedExperts(UnstackedModules):
    """An ExpertMLPs as E dense Mlps (UnstackedModules) in an MoE block's place: it runs the dense dispatch only."""

    def forward(
        self, x: Tensor, experts: Tensor, gates: Tensor, dispatch: str = "dense", groups: ExpertGroups | None = None
    ) -> Tensor:
        if dispatch != "dense" or groups is not None:
            raise ValueError(f"dispatch {dispatch!r}: an export view of the experts runs the dense dispatch only")
        return dense_mixture(self.experts(), x, experts, gates)


def unstacked_view(model: nn.Module) -> nn.Module:
    """`model` with every StackedModules in it as its `unstacked()` view, every Parameter and buffer shared (none
    copied): what the single-graph export traces. The model itself stays as it is."""
    shared = {id(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}  # deepcopy's memo
    view = copy.deepcopy(model, shared)
    for module in list(view.modules()):
        for name, child in module.named_children():
            if isinstance(child, StackedModules):
                setattr(module, name, child.unstacked())
    return view


class MoEBlock(Block):
    """MoE-ViT block: x + attn(LN(x)), then x + sum_i g_i * MLP_i(LN(x)); attention and norms shared by experts."""

    mlp: ExpertMLPs

    def forward(  # type: ignore[override]
        self, x: Tensor, routing: Routing, dispatch: str = "grouped", groups: ExpertGroups | None = None
    ) -> Tensor:
        """x: (B, T, D) -> (B, T, D), with routing.experts / routing.gates of shape (B, k); dispatch and groups: see
        ExpertMLPs (with groups, x and the result are in the groups' stream order)."""
        x = self.attend(x)
        return x + self.mlp(self.norm2(x), routing.experts, routing.gates, dispatch, groups)

    def with_expert(self, expert: int) -> Block:
        """A dense view of this block whose MLP is expert `expert`: shares every parameter, copies none."""
        return Block(self.norm1, self.attn, self.norm2, self.mlp.expert(expert))


def moe_block(cfg: ViTConfig, num_experts: int) -> MoEBlock:
    return MoEBlock(
        layer_norm(cfg),
        Attention(cfg.width, cfg.num_heads),
        layer_norm(cfg),
        ExpertMLPs(num_experts, cfg.width, cfg.mlp_hidden),
    )
