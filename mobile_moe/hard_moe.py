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
weights where they are but for weight decay, which shrinks them by lr x weight_decay a step. The router stage and
expert_path(e) are the same split as Mobile V-MoE's, so export treats routing "cluster" like its expert-paths layout.

Legend: B images, T tokens, D width, P pca_dims (D when there is no PCA), E experts, K classes, n_e images of expert e.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mobile_moe.config import HardMoEConfig
from mobile_moe.mobile_vmoe import RouterStage
from mobile_moe.moe import expert_groups
from mobile_moe.outputs import ModelOutput, Routing
from mobile_moe.routers import at_least_fp32, decided_in_fp32, top_k
from mobile_moe.vit import ClassifierHead, TokenEmbedding, dense_block, init_weights, pool_tokens


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


def gated_blocks(blocks: nn.ModuleList, tokens: Tensor, gate: Tensor) -> Tensor:
    """tokens (B, T, D), gate (B, 1) -> (B, T, D): whole pre-norm blocks whose residual branches the gate scales.

    x = x + g * attn(norm1 x); x = x + g * mlp(norm2 x). A Hard MoE's gate is always 1, which is exactly the dense
    blocks (1.0 * y is y, bit for bit); the gate is an input anyway so an expert graph has Mobile V-MoE's signature.
    """
    g = gate.reshape(-1, 1, 1).to(tokens.dtype)  # (B, 1, 1)
    x = tokens
    for block in blocks:
        x = x + g * block.attn(block.norm1(x))
        x = x + g * block.mlp(block.norm2(x))
    return x


class HardExpertPath(nn.Module):
    """(tokens (B, T, D), gate (B, 1)) -> logits (B, K) for images routed to one expert: its L blocks and its head (or
    the shared head). Holds exactly the weights one image needs after the router, shared with the model, not copied."""

    def __init__(self, blocks: nn.ModuleList, head: ClassifierHead, expert: int):
        super().__init__()
        self.expert = expert
        self.blocks = blocks
        self.head = head

    def forward(self, tokens: Tensor, gate: Tensor) -> Tensor:
        return self.head(gated_blocks(self.blocks, tokens, gate))


class HardMoE(nn.Module):
    """The whole model; training and evaluation call it, export splits it (router_stage, expert_path(e))."""

    def __init__(self, cfg: HardMoEConfig):
        super().__init__()
        self.config = cfg
        E, L = cfg.num_experts, cfg.moe_layers
        router = CentroidRouter(cfg.width, E, cfg.pca_dims, cfg.pool)
        trunk = nn.ModuleList(dense_block(cfg) for _ in range(cfg.dense_layers))
        self.router_stage = RouterStage(TokenEmbedding(cfg), trunk, router)
        self.expert_blocks = nn.ModuleList(nn.ModuleList(dense_block(cfg) for _ in range(L)) for _ in range(E))
        # One module per expert head, or one shared head (the paper's shared decoder); never both, so a state dict
        # holds every weight once.
        self.head = ClassifierHead(cfg) if cfg.shared_head else None
        self.expert_heads = None if cfg.shared_head else nn.ModuleList(ClassifierHead(cfg) for _ in range(E))
        self.apply(init_weights)
        # The gater is trained before the Hard MoE exists and never after: frozen for good, not just at load time.
        self.router_stage.requires_grad_(False)

    @property
    def router(self) -> CentroidRouter:
        return self.router_stage.router

    def head_of(self, expert: int) -> ClassifierHead:
        return self.head if self.head is not None else self.expert_heads[expert]

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

        route_to: refused (the router is fixed). dispatch "grouped" (training, eager): each expert runs once on its
        group; "dense": every expert on every image, weighted by the one-hot gates (the single-graph export).
        """
        tokens, routing = self.router_stage(images, route_to)
        return self._mix(self._run_blocks, tokens, routing, dispatch), routing

    def forward_head(self, tokens: Tensor, routing: Routing, dispatch: str = "grouped") -> Tensor:
        """tokens (B, T, D) -> logits (B, K) through each image's expert head (or the shared head)."""
        if self.head is not None:
            return self.head(tokens)
        return self._mix(lambda e, x, g: self.expert_heads[e](x), tokens, routing, dispatch)

    def forward(self, images: Tensor, route_to: Tensor | None = None, dispatch: str = "grouped") -> ModelOutput:
        """Grouped: each image through its expert's blocks and then its head in one pass over the batch sorted by
        expert (one grouping, one host read); dense: forward_features, then forward_head."""
        if dispatch != "grouped":
            tokens, routing = self.forward_features(images, route_to, dispatch)
            return ModelOutput(self.forward_head(tokens, routing, dispatch), routing)
        tokens, routing = self.router_stage(images, route_to)
        return ModelOutput(self._grouped(self._run_path, tokens, routing), routing)

    def _run_blocks(self, expert: int, tokens: Tensor, gate: Tensor) -> Tensor:
        return gated_blocks(self.expert_blocks[expert], tokens, gate)

    def _run_path(self, expert: int, tokens: Tensor, gate: Tensor) -> Tensor:
        """Expert `expert`'s blocks and head: HardExpertPath's calls, without building the module in the forward."""
        return self.head_of(expert)(self._run_blocks(expert, tokens, gate))

    def _mix(self, expert_fn: Callable[[int, Tensor, Tensor], Tensor], x: Tensor, routing: Routing, dispatch: str):
        """sum over the chosen expert e of g * expert_fn(e, x, g); with k = 1, just the chosen expert's output."""
        if dispatch == "dense":
            return self._dense(expert_fn, x, routing)
        if dispatch != "grouped":
            raise ValueError(f"dispatch {dispatch!r}: expected 'grouped' or 'dense'")
        return self._grouped(expert_fn, x, routing)

    def _grouped(self, expert_fn, x: Tensor, routing: Routing) -> Tensor:
        """x (B, ...) -> (B, ...'): the batch sorted by expert once (moe.expert_groups, one host read of the group
        sizes), each expert once on its contiguous slice, the outputs unsorted once.

        An expert with no images in the batch runs on an empty slice (no branch on the data), so its parameters get a
        zero gradient.
        """
        E = self.config.num_experts
        groups = expert_groups(routing.experts, routing.gates, E, read_sizes=True, sort_stream=True)
        if not groups.stream_sorted:  # k > 1: the slices below would not be each expert's images
            raise ValueError(f"a Hard MoE routes each image to one expert; this routing chose {groups.top_k}")
        slices = groups.to_stream(x).split(groups.host_sizes)  # per expert, its images (n_e, ...)
        gates = groups.gates.unsqueeze(-1).split(groups.host_sizes)  # per expert, (n_e, 1)
        return groups.from_stream(torch.cat([expert_fn(e, slices[e], gates[e]) for e in range(E)]))

    def _dense(self, expert_fn, x: Tensor, routing: Routing) -> Tensor:
        """Every expert on every image, weighted by the sparse gates: one graph that never branches on data."""
        B, E = x.shape[0], self.config.num_experts
        weights = routing.probs.new_zeros(B, E).scatter(-1, routing.experts, routing.gates)  # (B, E) one-hot
        outputs = torch.stack([expert_fn(e, x, routing.gates) for e in range(E)], dim=1)  # (B, E, ...')
        weights = weights.reshape(B, E, *([1] * (outputs.dim() - 2))).to(outputs.dtype)  # (B, E, 1, ...)
        return (weights * outputs).sum(dim=1)  # (B, ...')

    # --- the split, for export -------------------------------------------------------------------------------------

    def expert_path(self, expert: int) -> HardExpertPath:
        """Expert `expert`'s blocks and head (or the shared head), sharing this model's parameters."""
        if not 0 <= expert < self.config.num_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.config.num_experts - 1}")
        return HardExpertPath(self.expert_blocks[expert], self.head_of(expert), expert)

    # --- stage 1: from a trained dense gater -------------------------------------------------------------------------

    def dense_key(self, key: str) -> str | None:
        """Upcycling (mobile_moe/upcycle.py): the dense gater's entry `key` starts from: the first depth-L blocks for
        the frozen trunk, the last L blocks and the head for EVERY expert; None for the router's buffers, which
        mobile_moe/training/cluster_fit.py fits from the trunk's features afterwards."""
        part, _, rest = key.partition(".")
        if part == "router_stage":
            return None if rest.startswith("router.") else rest  # embedding.*, blocks.<i>.*: the same names
        if part == "expert_blocks":
            _expert, _, rest = rest.partition(".")
            index, _, rest = rest.partition(".")
            return f"blocks.{self.config.dense_layers + int(index)}.{rest}"
        if part == "expert_heads":
            return f"head.{rest.partition('.')[2]}"
        return key  # head.* (the shared head)
