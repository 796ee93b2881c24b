"""Rewrites that let XNNPACK take the whole graph: every op below would otherwise stay outside the delegate.

XNNPACK (ExecuTorch 1.5) has no 3-D mean and no select/unbind/squeeze/expand kernels, and the default
SDPA decomposition adds fully-masked-row handling (eq/any/where) that it cannot run. Undelegated ops run on the
portable CPU kernels and cut the graph into several delegates, so a phone pays for both. Each rewrite below is
exact up to float rounding and uses only ops the partitioner accepts (view, permute, slice, bmm, softmax, global
average pooling over a 4-D tensor's last two dims, rsqrt, add/sub/mul).
"""

from __future__ import annotations

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


def xnnpack_decompositions() -> dict:
    """torch.export's default decomposition table plus the rewrites above."""
    table = torch.export.default_decompositions()
    table.update(
        {
            aten.scaled_dot_product_attention.default: scaled_dot_product_attention,
            aten.mean.dim: mean_dim,
            aten.select.int: select_int,
            aten.unbind.int: unbind_int,
            aten.expand.default: expand,
        }
    )
    return table
