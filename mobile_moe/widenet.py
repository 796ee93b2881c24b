"""WideNet (Xue et al. 2021): go wider instead of deeper. ONE attention and ONE per-token MoE layer are shared by all
depth blocks; each block keeps its own two LayerNorms, so the blocks see differently scaled inputs.

    images -> embedding -> depth x [x + attn(LN1_i(x)); x + MoE(LN2_i(x))] -> head -> logits

The MoE layer is token_moe's (TokenChoiceRouter + ExpertMLPs: top-k, buffer capacity), with the Switch-style
load-balancing loss of the paper, no router noise and no Batch Prioritized Routing. The shared modules are held once
(attn, moe) and the per-block norms in two lists, so nothing is registered twice and the parameter count grows with
depth by the LayerNorms alone. Legend: B images, T tokens, D width, E experts, k choices per token.
"""

from __future__ import annotations

from torch import Tensor, nn

from mobile_moe.config import WideNetConfig
from mobile_moe.moe import ExpertMLPs
from mobile_moe.outputs import ModelOutput, MoEStats
from mobile_moe.token_moe import MoELayer, TokenChoiceRouter, merge_stats
from mobile_moe.vit import Attention, ClassifierHead, TokenEmbedding, init_weights


class WideNet(nn.Module):
    """timm's API: forward_features (tokens, MoEStats) -> forward_head (logits). One expert set (G = 1): the stats'
    expert_tokens (B, 1, E) sum what the shared experts took over all depth blocks."""

    def __init__(self, cfg: WideNetConfig):
        super().__init__()
        self.config = cfg
        self.embedding = TokenEmbedding(cfg)
        self.attn = Attention(cfg.width, cfg.num_heads)
        router = TokenChoiceRouter(
            cfg.width,
            cfg.num_experts,
            cfg.top_k,
            cfg.capacity_ratio,
            cfg.eval_capacity_ratio,
            noise_std=0.0,
            batch_prioritized=False,
            balance_loss="switch",
            aux_loss_weight=cfg.aux_loss_weight,
        )
        self.moe = MoELayer(router, ExpertMLPs(cfg.num_experts, cfg.width, cfg.mlp_hidden))
        self.norms1 = nn.ModuleList(nn.LayerNorm(cfg.width) for _ in range(cfg.depth))  # before attention
        self.norms2 = nn.ModuleList(nn.LayerNorm(cfg.width) for _ in range(cfg.depth))  # before the MoE layer
        self.head = ClassifierHead(cfg)
        self.apply(init_weights)

    def forward_features(self, images: Tensor) -> tuple[Tensor, MoEStats]:
        """(B, C, H, W) -> (tokens (B, T, D) before the final norm, MoEStats over the depth blocks, G = 1)."""
        x = self.embedding(images)  # (B, T, D)
        stats = []
        for norm1, norm2 in zip(self.norms1, self.norms2, strict=True):
            x = x + self.attn(norm1(x))
            y, block_stats = self.moe(norm2(x))
            x = x + y
            stats.append(block_stats)
        return x, merge_stats(stats, shared_experts=True)

    def forward_head(self, tokens: Tensor) -> Tensor:
        return self.head(tokens)

    def forward(self, images: Tensor) -> ModelOutput:
        tokens, stats = self.forward_features(images)
        return ModelOutput(self.forward_head(tokens), None, stats)
