"""Rewrites applied while lowering, so that every backend can run the graph and XNNPACK can take most of it.

`sort_decompositions()` (every backend): the toolkit's one top-k rule (mobile_moe.models.routers.top_k) is a STABLE
descending sort, and aten.sort is in no backend's op set: it is not Core ATen (ExecuTorch's verifier refuses it and
its portable kernels have no sort), the ONNX exporter has no translation for sort.stable, and Core ML's argsort
promises no order among ties. The rewrite ranks every element against every other (compare, sum, scatter), which
every backend runs and which keeps the tie rule exactly: equal values keep their index order.

`coreml_decompositions()` (Core ML) adds clamp_min/clamp_max as clamp, which coremltools converts for any bound.

`xnnpack_decompositions()` (ExecuTorch) adds rewrites that keep ops inside the XNNPACK delegate. XNNPACK (ExecuTorch
1.5) has no 3-D mean and no select/unbind/squeeze/expand kernels, and the default SDPA decomposition adds
fully-masked-row handling (eq/any/where) that it cannot run. Undelegated ops run on the portable CPU kernels and cut
the graph into several delegates, so a phone pays for both. Each of these is exact up to float rounding and uses only
ops the partitioner accepts (view, permute, slice, bmm, softmax, global average pooling over a 4-D tensor's last two
dims, rsqrt, add/sub/mul).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

aten = torch.ops.aten


def _pool_last(x4: Tensor) -> Tensor:
    """(M, 1, n, 1) -> (M, 1, 1, 1): the mean over n as average pooling (avg_pool2d is not rewritten again, unlike
    mean.dim, so the rewrites below do not recurse)."""
    return aten.avg_pool2d.default(x4, [x4.shape[2], 1])


def _mean_over_one_dim(x: Tensor, dim: int, keepdim: bool) -> Tensor:
    moved = x.movedim(dim, -1)  # (..., n)
    pooled = _pool_last(moved.reshape(-1, 1, moved.shape[-1], 1))  # (M, 1, 1, 1)
    out = pooled.reshape(moved.shape[:-1])  # (...)
    return out.unsqueeze(dim) if keepdim else out


def mean_dim(x: Tensor, dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
    dims = range(x.dim()) if dim is None or len(dim) == 0 else dim
    for d in sorted((d % x.dim() for d in dims), reverse=True):  # innermost first keeps the other indices valid
        x = _mean_over_one_dim(x, d, keepdim)
    return x if dtype is None else x.to(dtype)


# LayerNorm is deliberately NOT rewritten, although XNNPACK has no kernel for it: every rewrite we tried (mean and
# variance by average pooling, or by a matmul with a 1/D vector) lowered to graphs that disagree with eager PyTorch by
# up to 3e-2 on the router graph of a trained digits model (patch conv + LayerNorm + linear in one delegate), while
# exact on random weights. Correct logits beat one delegate; LayerNorm runs on ExecuTorch's portable kernel.
def native_layer_norm(x: Tensor, normalized_shape, weight: Tensor | None, bias: Tensor | None, eps: float):
    """LayerNorm over the last dim from pooling, sub, mul and rsqrt; returns (out, mean, rstd) like the aten op."""
    width = x.shape[-1]
    x4 = x.reshape(-1, 1, width, 1)  # (M, 1, D, 1)
    mean = _pool_last(x4)  # (M, 1, 1, 1)
    centred = x4 - mean
    var = _pool_last(centred * centred)  # (M, 1, 1, 1)
    rstd = torch.rsqrt(var + eps)
    out = (centred * rstd).reshape(x.shape)  # (..., D)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    stats_shape = (*x.shape[:-1], 1)
    return out, mean.reshape(stats_shape), rstd.reshape(stats_shape)


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
) -> Tensor:
    """softmax(q k^T * scale) v as two batched matmuls; the model never masks, so no masked-row handling is needed."""
    torch._assert(attn_mask is None and not is_causal, "export rewrite supports unmasked attention only")
    B, h, T, d = q.shape
    scale = d**-0.5 if scale is None else scale
    q3 = q.reshape(B * h, T, d) * scale  # (B*h, T, d)
    k3 = k.reshape(B * h, k.shape[2], d).transpose(1, 2)  # (B*h, d, S)
    weights = torch.bmm(q3, k3).softmax(dim=-1)  # (B*h, T, S)
    return torch.bmm(weights, v.reshape(B * h, v.shape[2], v.shape[3])).reshape(B, h, T, v.shape[3])


def select_int(x: Tensor, dim: int, index: int) -> Tensor:
    """x.select(dim, i) as a slice and a view."""
    shape = list(x.shape)
    del shape[dim]
    return x.narrow(dim, index % x.shape[dim], 1).reshape(shape)


def unbind_int(x: Tensor, dim: int = 0) -> tuple[Tensor, ...]:
    return tuple(select_int(x, dim, i) for i in range(x.shape[dim]))


def expand(x: Tensor, size, implicit: bool = False) -> Tensor:
    """expand that keeps the element count is a view (the class token at batch 1); otherwise broadcast with an add."""
    lead = len(size) - x.dim()
    size = [x.shape[i - lead] if s == -1 else s for i, s in enumerate(size)]
    if x.numel() == torch.Size(size).numel():
        return x.reshape(size)
    return x + x.new_zeros(size)


def _rank_sort(x: Tensor, dim: int, descending: bool) -> tuple[Tensor, Tensor]:
    """(values, indices) of a stable sort of x along dim, from ranks instead of a sort kernel.

    Element i lands at rank_i = #{j ahead of i} + #{j before i with an equal value}: n^2 comparisons for n sorted
    items (experts, or the tokens of one image), cheap at these sizes. Every value is copied, never computed, so the
    result is bit-exact, and ties keep index order (the stable sort's, and the top-k rule's).
    """
    moved = x.movedim(dim, -1)  # (..., n)
    n = moved.shape[-1]
    mine = moved.unsqueeze(-1)  # (..., n, 1): element i
    other = moved.unsqueeze(-2)  # (..., 1, n): element j
    position = torch.arange(n, device=x.device)  # (n,)
    ahead = other > mine if descending else other < mine  # (..., n, n): j sorts strictly before i
    # logical_and/or, not & and |: those trace to aten.__and__/__or__, which Core ML's converter does not know; and the
    # count is taken over integers, not booleans, which Core ML would sum as floats (scatter needs integer indices).
    tied_before = torch.logical_and(other == mine, position < position.unsqueeze(-1))  # (..., n, n): equal, j < i
    rank = torch.logical_or(ahead, tied_before).to(torch.int64).sum(dim=-1)  # (..., n): where element i lands
    values = torch.zeros_like(moved).scatter(-1, rank, moved)  # (..., n)
    indices = torch.zeros_like(rank).scatter(-1, rank, position.expand(rank.shape))  # (..., n)
    return values.movedim(-1, dim), indices.movedim(-1, dim)


def sort_stable(x: Tensor, *, stable: bool | None = None, dim: int = -1, descending: bool = False):
    return _rank_sort(x, dim, descending)


def sort_default(x: Tensor, dim: int = -1, descending: bool = False):
    """An unstable sort may order ties any way; the stable order is one of them (and the one eager PyTorch gives)."""
    return _rank_sort(x, dim, descending)


def sort_decompositions() -> dict:
    """aten.sort (and argsort, which decomposes into it) as ranks: for every backend's export."""
    return {aten.sort.stable: sort_stable, aten.sort.default: sort_default}


def clamp_min(x: Tensor, min) -> Tensor:
    """clamp_min as clamp: coremltools 9 converts clamp_min only when the bound has x's dtype (it asserts, so
    `distances.clamp_min(0)` on floats fails), while its clamp promotes the bound first. Same values. The open side
    is infinite, not left out: coremltools would fill in float32's largest value, which overflows fp16."""
    return aten.clamp.default(x, min, math.inf if x.is_floating_point() else None)


def clamp_max(x: Tensor, max) -> Tensor:
    return aten.clamp.default(x, -math.inf if x.is_floating_point() else None, max)


def coreml_decompositions() -> dict:
    """The sort rewrite, and clamp_min/clamp_max as clamp (coremltools' converter, see clamp_min)."""
    return {**sort_decompositions(), aten.clamp_min.default: clamp_min, aten.clamp_max.default: clamp_max}


def xnnpack_rewrites() -> dict:
    """The rewrites above that keep ops inside XNNPACK, alone."""
    return {
        **sort_decompositions(),
        aten.scaled_dot_product_attention.default: scaled_dot_product_attention,
        aten.mean.dim: mean_dim,
        aten.select.int: select_int,
        aten.unbind.int: unbind_int,
        aten.expand.default: expand,
    }


def xnnpack_decompositions() -> dict:
    """torch.export's default decomposition table plus the rewrites above."""
    table = torch.export.default_decompositions()
    table.update(xnnpack_rewrites())
    return table
