"""WideNet (Xue et al. 2021): go wider instead of deeper. ONE attention and ONE per-token MoE layer are shared by all
depth blocks; each block keeps its own two LayerNorms, so the blocks see differently scaled inputs.

    images -> embedding -> depth x [x + attn(LN1_i(x)); x + MoE(LN2_i(x))] -> head -> logits

The MoE layer is token_moe's (TokenChoiceRouter + ExpertMLPs: top-k, buffer capacity), with the paper's router
noise (N(0, 1/E^2) while training, Eq. 2), its Switch-style load-balancing loss (Eq. 3-5) and no Batch Prioritized
Routing. The shared modules are held once (attn, moe) and the per-block norms in two lists, so nothing is registered
twice and the parameter count grows with depth by the LayerNorms alone.
Legend: B images, T tokens, D width, E experts, k choices per token.
"""

from __future__ import annotations

import copy

from torch import Tensor, nn

from mobile_moe.models.config import WideNetConfig
from mobile_moe.models.moe import ExpertMLPs
from mobile_moe.models.token_moe import MoELayer, merge_stats, token_choice_router
from mobile_moe.models.vit import Attention, ClassifierHead, TokenEmbedding, init_weights, layer_norm
from mobile_moe.utils.outputs import ModelOutput, MoEStats


class WideNet(nn.Module):
    """timm's API: forward_features (tokens, MoEStats) -> forward_head (logits). One expert set (G = 1): the stats'
    expert_tokens (B, 1, E) sum what the shared experts took over all depth blocks."""

    def __init__(self, cfg: WideNetConfig):
        super().__init__()
        self.config = cfg
        self.embedding = TokenEmbedding(cfg)
        self.attn = Attention(cfg.width, cfg.num_heads)
        router = token_choice_router(cfg, balance_loss="switch", batch_prioritized=False)
        self.moe = MoELayer(router, ExpertMLPs(cfg.num_experts, cfg.width, cfg.mlp_hidden))
        self.norms1 = nn.ModuleList(layer_norm(cfg) for _ in range(cfg.depth))  # before attention
        self.norms2 = nn.ModuleList(layer_norm(cfg) for _ in range(cfg.depth))  # before the MoE layer
        self.head = ClassifierHead(cfg)
        self.apply(init_weights)

    def forward_features(self, images: Tensor) -> tuple[Tensor, MoEStats]:
        """(B, C, H, W) -> (tokens (B, T, D) before the final norm, MoEStats over the depth blocks, G = 1)."""
        x = self.embedding(images)  # (B, T, D)
        stats = []
        for i, (norm1, norm2) in enumerate(zip(self.norms1, self.norms2, strict=True)):
            attn, moe = self.shared_layers(i)
            x = x + attn(norm1(x))
            y, block_stats = moe(norm2(x))
            x = x + y
            stats.append(block_stats)
        return x, merge_stats(stats, shared_experts=True)

    def shared_layers(self, block: int) -> tuple[nn.Module, nn.Module]:
        """The attention and MoE layer block `block` runs: the shared ones, or their per-block views (see below)."""
        if "block_views" in self._modules:
            attn, moe = self.block_views[block]
            return attn, moe
        return self.attn, self.moe

    def graph_capture_view(self) -> WideNet:
        """This model with its shared attention and MoE layer as one module object per block, every Parameter shared
        (none copied): what export traces. XNNPACK's partitioner groups the ops of a graph by the module that made
        them, and declines a linear that ONE module produced in every block: a 4-block WideNet kept its 52 linears on
        ExecuTorch's portable kernels, 16x slower (5.6 ms vs 0.34 ms on digits, same outputs, same file size)."""
        view = copy.copy(self)
        view._modules = dict(self._modules)  # the view's own module table; the original stays as it is
        parameters = {id(p): p for p in self.parameters()}  # deepcopy's memo: every Parameter maps to itself
        views = (nn.ModuleList(copy.deepcopy([self.attn, self.moe], dict(parameters))) for _ in self.norms1)
        view.block_views = nn.ModuleList(views)
        return view

    def forward_head(self, tokens: Tensor) -> Tensor:
        return self.head(tokens)

    def forward(self, images: Tensor) -> ModelOutput:
        tokens, stats = self.forward_features(images)
        return ModelOutput(self.forward_head(tokens), None, stats)
