"""Hard MoE (Gross et al. 2017) on Mobile V-MoE's split: a frozen dense gater picks ONE expert per image by the
nearest k-means centroid of its features; an expert is the last L whole blocks and a classifier head.

    images -> [RouterStage: embedding, depth-L frozen gater blocks, CentroidRouter] -> tokens, routing
           -> [expert e: its own L blocks (attention, MLP, norms)] -> [its head, or the shared head] -> logits

The paper clusters the last hidden layer of the whole dense model; here the features are the gater's pooled tokens at
the split point (after its first depth-L blocks), so that the router costs no more than that trunk and the experts
continue from the very tokens it computed: the adaptation that lets a Hard MoE split like a Mobile V-MoE.

Unlike Mobile V-MoE nothing is learned end to end: the gater is a trained dense `vit` whose first depth-L blocks are
copied and frozen, the centroids are fitted once on its pooled training features (mobile_moe/training/cluster_fit.py),
and every expert starts as a copy of the gater's last L blocks and head (upcycling), then trains on the images of its
cluster only. An expert whose cluster is empty gets zero gradients (it runs on an empty batch), so AdamW leaves its
weights where they are but for weight decay, which shrinks its matrices by lr x weight_decay a step. The router stage
and expert_path(e) are the same split as Mobile V-MoE's, so export treats routing "cluster" like its expert-paths
layout.

Legend: B images, T tokens, D width, P pca_dims (D when there is no PCA), E experts, K classes, n_e images of expert e.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mobile_moe.models.config import HardMoEConfig
from mobile_moe.models.mobile_vmoe import RouterStage
from mobile_moe.models.moe import (
    ExpertGroups,
    StackedModules,
    compute_dtype,
    expert_groups,
    grouped_gemm_fits,
    grouped_linear,
    grouped_mlp,
)
from mobile_moe.models.routers import at_least_fp32, decided_in_fp32, top_k
from mobile_moe.models.vit import (
    Block,
    ClassifierHead,
    TokenEmbedding,
    attention_heads,
    dense_block,
    init_weights,
    pool_tokens,
)
from mobile_moe.utils.outputs import ModelOutput, Routing


class CentroidRouter(nn.Module):
    """Nearest k-means centroid of the pooled gater features, after an optional PCA: a fixed, non-trainable router.

    Its state is three buffers (so they live in state_dict and checkpoints, and never reach an optimizer):
    pca_mean (D,), pca_components (P, D) (both absent when pca_dims is 0: plain k-means on the features) and
    centroids (E, P). Until `set_clusters` fills them every centroid is 0: all distances tie and every image goes to
    expert 0 (ties go to the lowest index, the toolkit's top-k rule).
    """

    def __init__(self, width: int, num_experts: int, pca_dims: int, pool: str):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = 1
        self.pool = pool
        self.pca_dims = pca_dims
        if pca_dims:
            self.register_buffer("pca_mean", torch.zeros(width))
            self.register_buffer("pca_components", torch.eye(pca_dims, width))
        self.register_buffer("centroids", torch.zeros(num_experts, pca_dims or width))

    def set_clusters(self, mean: Tensor | None, components: Tensor | None, centroids: Tensor) -> None:
        """Store a fitted PCA (mean (D,), components (P, D); None without PCA) and k-means centroids (E, P)."""
        if self.pca_dims:
            if mean is None or components is None:
                raise ValueError(f"pca_dims={self.pca_dims}: set_clusters needs the PCA mean and components")
            self._copy("pca_mean", mean)
            self._copy("pca_components", components)
        elif mean is not None or components is not None:
            raise ValueError("pca_dims=0: this router clusters the features themselves; pass mean=components=None")
        self._copy("centroids", centroids)

    def _copy(self, name: str, value: Tensor) -> None:
        buffer = getattr(self, name)
        value = torch.as_tensor(value)
        if value.shape != buffer.shape:
            raise ValueError(f"{name}: expected shape {tuple(buffer.shape)}, got {tuple(value.shape)}")
        buffer.copy_(value)

    def project(self, features: Tensor) -> Tensor:
        """(B, D) pooled gater features -> (B, P): the space the centroids live in."""
        if not self.pca_dims:
            return features
        return (features - self.pca_mean) @ self.pca_components.T  # (B, P)

    def distances(self, features: Tensor) -> Tensor:
        """(B, D) -> (B, E) squared euclidean distances to the centroids, as |z|^2 - 2 z.c + |c|^2 (scikit-learn's
        form): one matmul, which FLOP counters and mobile backends know, instead of a (B, E, P) difference.

        In float32 under autocast too (routers.decided_in_fp32): bf16 would move an image near a cluster border to
        another cluster than the float32 fit and the exported router give it.
        """
        with decided_in_fp32(features):
            z = self.project(at_least_fp32(features))  # (B, P)
            c = self.centroids  # (E, P)
            squared = z.square().sum(-1, keepdim=True) - 2 * z @ c.T + c.square().sum(-1)  # (B, E)
            return squared.clamp_min(0)  # rounding can take a point on a centroid just below 0

    def forward(self, tokens: Tensor, route_to: Tensor | None = None) -> Routing:
        """tokens (B, T, D) -> Routing: logits -distances (B, E); probs the one-hot of the nearest centroid (B, E);
        experts (B, 1); gates (B, 1) = 1. Export-safe: no data-dependent shapes (the one-hot is a scatter)."""
        if route_to is not None:
            raise ValueError("a Hard MoE routes by its fixed k-means centroids; it has no label routing (route_to)")
        logits = -self.distances(pool_tokens(tokens, self.pool))  # (B, E)
        experts = top_k(logits, 1)[1]  # (B, 1): the nearest centroid, ties to the lowest index
        probs = torch.zeros_like(logits).scatter(-1, experts, 1.0)  # (B, E) one-hot
        return Routing(logits, probs, experts, probs.gather(-1, experts))


class GatedBlock(Block):
    """A pre-norm block whose residual branches a gate (B, 1) scales: x = x + g * attn(norm1 x), then
    x = x + g * mlp(norm2 x).

    A Hard MoE's gate is always 1, which is exactly the dense block (1.0 * y is y, bit for bit); the gate is an input
    anyway so an expert graph has Mobile V-MoE's signature.
    """

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:  # type: ignore[override]
        g = gate.reshape(-1, 1, 1).to(x.dtype)  # (B, 1, 1)
        x = x + g * self.attn(self.norm1(x))
        return x + g * self.mlp(self.norm2(x))


def gated_block(cfg: HardMoEConfig) -> GatedBlock:
    block = dense_block(cfg)
    return GatedBlock(block.norm1, block.attn, block.norm2, block.mlp)


class ExpertHead(ClassifierHead):
    """An expert's classifier head: tokens (B, T, D) -> logits (B, K). It takes the gate as every expert stage does
    (HardMoE._experts) and leaves the logits ungated."""

    def forward(self, tokens: Tensor, gate: Tensor | None = None) -> Tensor:  # type: ignore[override]
        return super().forward(tokens)


def grouped_norm(x: Tensor, weight: Tensor, bias: Tensor, *, groups: ExpertGroups, eps: float) -> Tensor:
    """x (N, T, D) grouped by expert -> LayerNorm with each row's expert's weight and bias (stacks (E, D))."""
    normed = F.layer_norm(x, (x.shape[-1],), eps=eps)
    return normed * weight[groups.chosen].unsqueeze(1) + bias[groups.chosen].unsqueeze(1)


class ExpertBlocks(StackedModules):
    """Block j of every expert: E pre-norm blocks (vit.Block) held as stacks (moe.StackedModules): norm1_weight (E, D),
    attn_qkv_weight (E, D, 3D), attn_proj_weight (E, D, D), norm2_*, mlp_fc1_weight (E, D, F), mlp_fc2_weight (E, F, D)
    and their biases. Expert e's block is `expert(e)`, a GatedBlock of views; `experts()` runs each on (x, gate)."""

    def __init__(self, cfg: HardMoEConfig):
        super().__init__([gated_block(cfg) for _ in range(cfg.num_experts)])
        self.num_heads, self.eps = cfg.num_heads, cfg.norm_eps

    def grouped(self, x: Tensor, groups: ExpertGroups) -> Tensor:
        """x (N, T, D) sorted by expert -> every image through its expert's block in a fixed number of kernels and no
        host read: gathered norm weights, four grouped GEMMs (qkv, proj, fc1, fc2) in autocast's dtype, and attention
        over the whole batch (it is per image, so the order does not matter to it)."""
        dtype = compute_dtype(x)
        g = groups.gates.view(-1, 1, 1).to(x.dtype)
        normed = grouped_norm(x, self.norm1_weight, self.norm1_bias, groups=groups, eps=self.eps).to(dtype)
        qkv = grouped_linear(normed, self.attn_qkv_weight, self.attn_qkv_bias, groups=groups)
        attended = grouped_linear(attention_heads(qkv, self.num_heads), self.attn_proj_weight, self.attn_proj_bias,
                                  groups=groups)  # fmt: skip
        x = x + g * attended.to(x.dtype)
        normed = grouped_norm(x, self.norm2_weight, self.norm2_bias, groups=groups, eps=self.eps).to(dtype)
        mlp = (self.mlp_fc1_weight, self.mlp_fc1_bias, self.mlp_fc2_weight, self.mlp_fc2_bias)
        return x + g * grouped_mlp(normed, *mlp, groups=groups).to(x.dtype)


class ExpertHeads(StackedModules):
    """Every expert's classifier head (vit.ClassifierHead: final norm, pooling, linear) held as stacks: norm_weight
    (E, D), norm_bias (E, D), fc_weight (E, D, K), fc_bias (E, K). Expert e's head is `expert(e)`, an ExpertHead of
    views."""

    def __init__(self, cfg: HardMoEConfig):
        super().__init__([ExpertHead(cfg) for _ in range(cfg.num_experts)])
        self.pool, self.eps = cfg.pool, cfg.norm_eps

    def grouped(self, tokens: Tensor, groups: ExpertGroups) -> Tensor:
        """tokens (N, T, D) sorted by expert -> logits (N, K): gathered norm weights, one grouped GEMM."""
        normed = grouped_norm(tokens, self.norm_weight, self.norm_bias, groups=groups, eps=self.eps)
        pooled = pool_tokens(normed, self.pool).to(compute_dtype(tokens)).unsqueeze(1)  # (N, 1, D)
        return grouped_linear(pooled, self.fc_weight, self.fc_bias, groups=groups).squeeze(1)


class HardExpertPath(nn.Module):
    """(tokens (B, T, D), gate (B, 1)) -> logits (B, K) for images routed to one expert: its L blocks and its head (or
    the shared head), modules whose parameters are views of the model's stacks: exactly the weights one image needs
    after the router, shared with the model, not copied."""

    def __init__(self, blocks: Sequence[GatedBlock], head: ClassifierHead, expert: int):
        super().__init__()
        self.expert = expert
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, tokens: Tensor, gate: Tensor) -> Tensor:
        x = tokens
        for block in self.blocks:
            x = block(x, gate)
        return self.head(x)


class HardMoE(nn.Module):
    """The whole model; training and evaluation call it, export splits it (router_stage, expert_path(e)).

    Each expert's L blocks and head are held stacked (ExpertBlocks, one per block index; ExpertHeads), so that on a
    grouped-GEMM device the whole batch runs each layer of every expert in one kernel with no host read, and elsewhere
    one loop over the experts runs each on its slice of the sorted batch.
    """

    def __init__(self, cfg: HardMoEConfig):
        super().__init__()
        self.config = cfg
        router = CentroidRouter(cfg.width, cfg.num_experts, cfg.pca_dims, cfg.pool)
        trunk = nn.ModuleList(dense_block(cfg) for _ in range(cfg.dense_layers))
        self.router_stage = RouterStage(TokenEmbedding(cfg), trunk, router)
        self.expert_blocks = nn.ModuleList(ExpertBlocks(cfg) for _ in range(cfg.moe_layers))
        # Heads stacked per expert, or one shared head (the paper's shared decoder); never both, so a state dict
        # holds every weight once.
        self.head = ClassifierHead(cfg) if cfg.shared_head else None
        self.expert_heads = None if cfg.shared_head else ExpertHeads(cfg)
        self.apply(init_weights)
        # The gater is trained before the Hard MoE exists and never after: frozen for good, not just at load time.
        self.router_stage.requires_grad_(False)

    @property
    def router(self) -> CentroidRouter:
        return self.router_stage.router

    # --- forward -------------------------------------------------------------------------------------------------

    def image_features(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, D): the pooled gater features the router clusters (what stage 1 fits k-means on)."""
        x = self.router_stage.embedding(images)  # (B, T, D)
        for block in self.router_stage.blocks:
            x = block(x)
        return pool_tokens(x, self.config.pool)

    def forward_features(
        self, images: Tensor, route_to: Tensor | None = None, dispatch: str = "grouped"
    ) -> tuple[Tensor, Routing]:
        """(B, C, H, W) -> (tokens (B, T, D) after each image's expert blocks, before the final norm, Routing).

        route_to: refused (the router is fixed). dispatch "grouped" (training, evaluation): each image through its own
        expert only; "dense": every expert on every image, weighted by the one-hot gates (the single-graph export).
        """
        tokens, routing = self.router_stage(images, route_to)
        return self._experts(list(self.expert_blocks), tokens, routing, dispatch), routing

    def forward_head(self, tokens: Tensor, routing: Routing, dispatch: str = "grouped") -> Tensor:
        """tokens (B, T, D) -> logits (B, K) through each image's expert head (or the shared head)."""
        if self.head is not None:
            return self.head(tokens)
        return self._experts([self.expert_heads], tokens, routing, dispatch)

    def forward(self, images: Tensor, route_to: Tensor | None = None, dispatch: str = "grouped") -> ModelOutput:
        """Each image through its expert's blocks and then its head, in one pass over the batch sorted by expert."""
        tokens, routing = self.router_stage(images, route_to)
        stages = [*self.expert_blocks, *([] if self.expert_heads is None else [self.expert_heads])]
        x = self._experts(stages, tokens, routing, dispatch)
        return ModelOutput(x if self.head is None else self.head(x), routing)

    def _experts(self, stages: list[nn.Module], tokens: Tensor, routing: Routing, dispatch: str) -> Tensor:
        """tokens (B, T, D) -> each image through its expert's `stages` (ExpertBlocks, ExpertHeads, in order).

        Grouped: the batch sorted by expert once (moe.expert_groups), every stage run on the sorted batch, the result
        unsorted once: as grouped GEMMs on a grouped-GEMM device, elsewhere by the per-expert loop (one host read of
        the group sizes; an expert with no images is left out, _expert_loop). An expert with no images gets a zero
        gradient.
        """
        if dispatch == "dense":
            return self._dense(stages, tokens, routing)
        if dispatch != "grouped":
            raise ValueError(f"dispatch {dispatch!r}: expected 'grouped' or 'dense'")
        grouped = grouped_gemm_fits(tokens, self.config.width, self.config.mlp_hidden,
                                    on_grouped_gemm_device=self.expert_blocks[0].on_grouped_gemm_device)  # fmt: skip
        E = self.config.num_experts
        groups = expert_groups(routing.experts, routing.gates, E, read_sizes=not grouped, sort_stream=True)
        if not groups.stream_sorted:  # k > 1: the slices below would not be each expert's images
            raise ValueError(f"a Hard MoE routes each image to one expert; this routing chose {groups.top_k}")
        x = groups.to_stream(tokens)
        if grouped:
            for stage in stages:
                x = stage.grouped(x, groups)
        else:
            x = self._expert_loop(stages, x, groups)
        return groups.from_stream(x)

    @staticmethod
    def _expert_loop(stages: list[nn.Module], x: Tensor, groups: ExpertGroups) -> Tensor:
        """x (B, T, D) sorted by expert -> each expert's stages, one after another, on its contiguous slice.

        No stage ever runs on an empty batch: CUDA's attention kernels do not take one (scaled_dot_product_attention
        gave None for a (0, 16, 96) bf16 batch on an H200). Eagerly, an expert with no images is skipped (its sizes are
        on the host already: no sync); compiled, where the sizes are symbolic and a branch on them would guard on the
        data, every expert runs on its rows plus one row of zeros, cut off after (its gradient is zero)."""
        runs = [stage.experts() for stage in stages]  # one unbind per stack
        slices, gates = x.split(groups.host_sizes), groups.gates.unsqueeze(-1).split(groups.host_sizes)
        padded = torch.compiler.is_compiling()
        outputs = []
        for e, (rows, gate) in enumerate(zip(slices, gates, strict=True)):  # each expert's (n_e, T, D), (n_e, 1)
            if padded:
                count = rows.shape[0]
                rows = torch.cat([rows, rows.new_zeros(1, *rows.shape[1:])])
                gate = torch.cat([gate, gate.new_zeros(1, 1)])
            elif rows.shape[0] == 0:
                continue
            for experts in runs:
                rows = experts[e](rows, gate)
            outputs.append(rows[:count] if padded else rows)
        return torch.cat(outputs)

    def _dense(self, stages: list[nn.Module], tokens: Tensor, routing: Routing) -> Tensor:
        """Every expert's stages on every image, weighted by the sparse gates: one graph that never branches on data."""
        B, E = tokens.shape[0], self.config.num_experts
        runs = [stage.experts() for stage in stages]
        outputs = []
        for e in range(E):
            x = tokens
            for experts in runs:
                x = experts[e](x, routing.gates)
            outputs.append(x)
        stacked_outputs = torch.stack(outputs, dim=1)  # (B, E, ...')
        weights = routing.probs.new_zeros(B, E).scatter(-1, routing.experts, routing.gates)  # (B, E) one-hot
        weights = weights.reshape(B, E, *([1] * (stacked_outputs.dim() - 2))).to(stacked_outputs.dtype)
        return (weights * stacked_outputs).sum(dim=1)  # (B, ...')

    # --- the split, for export -------------------------------------------------------------------------------------

    def expert_path(self, expert: int) -> HardExpertPath:
        """Expert `expert`'s blocks and head (or the shared head) as dense modules of views of the stacks."""
        if not 0 <= expert < self.config.num_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.config.num_experts - 1}")
        head = self.head if self.head is not None else self.expert_heads.expert(expert)
        return HardExpertPath([stage.expert(expert) for stage in self.expert_blocks], head, expert)

    # --- stage 1: from a trained dense gater -------------------------------------------------------------------------

    def dense_key(self, key: str) -> str | None:
        """Upcycling (mobile_moe/models/upcycle.py): the dense gater's entry `key` starts from: the first depth-L blocks
        for the frozen trunk, the last L blocks and the head for EVERY expert; None for the router's buffers, which
        mobile_moe/training/cluster_fit.py fits from the trunk's features afterwards."""
        part, _, rest = key.partition(".")
        if part == "router_stage":
            return None if rest.startswith("router.") else rest  # embedding.*, blocks.<i>.*: the same names
        if part == "expert_blocks":  # expert_blocks.<j>.<stacked entry>: one dense entry for every expert
            index, _, entry = rest.partition(".")
            return f"blocks.{self.config.dense_layers + int(index)}.{self.expert_blocks[int(index)].dense_names[entry]}"
        if part == "expert_heads":
            return f"head.{self.expert_heads.dense_names[rest]}"
        return key  # head.* (the shared head)
