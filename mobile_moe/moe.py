"""The MoE layer: E expert MLPs, grouped dispatch, and the MoE-ViT block (shared attention and norms).

Legend: B routed items (images, for a per-image router), T tokens, D width, E experts, k experts per item,
n_e items routed to expert e (sum over e of n_e = B * k).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mobile_moe.config import ViTConfig
from mobile_moe.outputs import Routing
from mobile_moe.vit import Attention, Block, Mlp, layer_norm


def expert_groups(chosen: Tensor, num_experts: int) -> tuple[Tensor, ...]:
    """(N,) the expert of each routed item -> for each expert e, the indices of its items, (n_e,) in item order.

    One stable sort; torch.cat of the groups is the sort order itself. The group sizes are counted into a tensor of
    static shape (E,) and read on the host once per call. Under torch.compile with dynamo's capture_scalar_outputs
    (compile_model sets it) they become unbacked symbolic sizes: a new size pattern neither breaks the graph nor
    recompiles it. Exported graphs never get here: they hold one expert each.
    """
    order = torch.argsort(chosen, stable=True)  # (N,): items grouped by expert
    experts = torch.arange(num_experts, device=chosen.device)
    sizes = (chosen.unsqueeze(-1) == experts).sum(0)  # (E,) n_e; bincount's output shape depends on the data
    return order.split(sizes.tolist())


def compile_model(module: nn.Module, **options) -> nn.Module:
    """torch.compile(module, **options) for any model of the registry (or a module wrapping one), so that the
    grouped dispatch compiles to one graph: the group sizes it reads on the host are traced as unbacked symbolic ints
    (torch._dynamo.config.capture_scalar_outputs, a process-wide setting that leaves other code's graphs as they were
    unless they read tensors on the host too, which then trace instead of breaking)."""
    torch._dynamo.config.capture_scalar_outputs = True
    return torch.compile(module, **options)


class ExpertMLPs(nn.Module):
    """E independent MLPs. Each is its own module so an exported expert graph holds only its own weights."""

    def __init__(self, num_experts: int, width: int, hidden: int):
        super().__init__()
        self.experts = nn.ModuleList(Mlp(width, hidden) for _ in range(num_experts))

    def __len__(self) -> int:
        return len(self.experts)

    def forward(self, x: Tensor, experts: Tensor, gates: Tensor, dispatch: str = "grouped") -> Tensor:
        """sum over the chosen experts i of g_i * MLP_i(x).

        dispatch "grouped" (training, eager): O(k) MLP runs per item; "dense": every expert on every item, weighted by
        the sparse gates (dense_mixture), for a single exportable graph that never branches on data.
        """
        if dispatch == "dense":
            return dense_mixture(self, x, experts, gates)
        if dispatch != "grouped":
            raise ValueError(f"dispatch {dispatch!r}: expected 'grouped' or 'dense'")
        return self._grouped(x, experts, gates)

    def _grouped(self, x: Tensor, experts: Tensor, gates: Tensor) -> Tensor:
        """O(k) MLP runs per item, not O(E).

        x: (B, T, D); experts, gates: (B, k). Items are grouped by expert (one stable sort), each expert runs once on
        its group (gather -> MLP -> scatter-add). The group sizes are read on the host once per call (expert_groups):
        this is the training path, eager or compiled; exported graphs hold one expert each and never branch on data.
        """
        B, k = experts.shape
        flat_experts = experts.reshape(-1)  # (B*k,)
        flat_items = torch.arange(B, device=x.device).repeat_interleave(k)  # (B*k,): item of each (item, choice)
        flat_gates = gates.reshape(-1)  # (B*k,)
        out = torch.zeros_like(x)  # (B, T, D)
        # An expert with no items runs on an empty batch (no branch on the data, so compiled graphs need no guard).
        for expert, group in zip(self.experts, expert_groups(flat_experts, len(self.experts)), strict=True):
            items = flat_items[group]  # (n_e,)
            y = expert(x[items]) * flat_gates[group].view(-1, 1, 1).to(x.dtype)  # (n_e, T, D)
            out.index_add_(0, items, y)
        return out


def dense_mixture(experts: ExpertMLPs, x: Tensor, chosen: Tensor, gates: Tensor) -> Tensor:
    """Reference mixture: run all E experts on every item and weight by the sparse gate vector.

    Costs E/k times the FLOPs of the grouped dispatch. It exists for tests (the grouped dispatch must equal it) and
    for the naive single-graph export that benchmarks compare against; never use it for training.
    """
    B, E = chosen.shape[0], len(experts)
    weights = gates.new_zeros(B, E).scatter(-1, chosen, gates)  # (B, E), zero off the top-k
    outputs = torch.stack([expert(x) for expert in experts.experts], dim=1)  # (B, E, T, D)
    return torch.einsum("be,betd->btd", weights.to(x.dtype), outputs)  # (B, T, D)


class MoEBlock(Block):
    """MoE-ViT block: x + attn(LN(x)), then x + sum_i g_i * MLP_i(LN(x)); attention and norms shared by experts."""

    mlp: ExpertMLPs

    def forward(self, x: Tensor, routing: Routing, dispatch: str = "grouped") -> Tensor:  # type: ignore[override]
        """x: (B, T, D) -> (B, T, D), with routing.experts / routing.gates of shape (B, k); dispatch: see ExpertMLPs."""
        x = self.attend(x)
        return x + self.mlp(self.norm2(x), routing.experts, routing.gates, dispatch)

    def with_expert(self, expert: int) -> Block:
        """A dense view of this block whose MLP is expert `expert`: shares every parameter, copies none."""
        return Block(self.norm1, self.attn, self.norm2, self.mlp.experts[expert])


def moe_block(cfg: ViTConfig, num_experts: int) -> MoEBlock:
    return MoEBlock(
        layer_norm(cfg),
        Attention(cfg.width, cfg.num_heads),
        layer_norm(cfg),
        ExpertMLPs(num_experts, cfg.width, cfg.mlp_hidden),
    )
