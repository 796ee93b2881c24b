"""Dense Vision Transformer, read top to bottom: layers, block, model. Its config lives in config.py (torch-free).

Shapes: B images, C channels, H x W pixels, P patch size, N = (H/P)(W/P) patches, T tokens (N, plus one under cls
pooling), D width, h heads, d = D/h head size, F MLP hidden size, K classes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mobile_moe.models.config import ViTConfig
from mobile_moe.utils.outputs import ModelOutput


class PatchEmbed(nn.Module):
    """Non-overlapping P x P patches -> D-dim tokens, as one strided convolution."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.proj = nn.Conv2d(cfg.in_chans, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size)

    def forward(self, images: Tensor) -> Tensor:
        x = self.proj(images)  # (B, D, H/P, W/P)
        return x.flatten(2).transpose(1, 2)  # (B, N, D)


class Attention(nn.Module):
    """Multi-head self-attention with a fused QKV projection."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(attention_heads(self.qkv(x), self.num_heads))


def attention_heads(qkv: Tensor, num_heads: int) -> Tensor:
    """(B, T, 3D) fused query, key and value projections -> (B, T, D): scaled dot-product attention in each of the
    heads, concatenated (Attention between its two projections)."""
    B, T, D = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    q, k, v = qkv.reshape(B, T, 3, num_heads, D // num_heads).permute(2, 0, 3, 1, 4).unbind(0)  # each (B, h, T, d)
    x = F.scaled_dot_product_attention(q, k, v)  # (B, h, T, d)
    return x.transpose(1, 2).reshape(B, T, D)


class Mlp(nn.Module):
    """D -> F -> D with GELU: the part of a block that Mobile V-MoE turns into experts."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + mlp(LN(x)).

    Built from its parts so that an MoE block can hand out a dense view of itself with one expert as the MLP, sharing
    (not copying) the attention and norms: that view is what an exported expert graph holds.
    """

    def __init__(self, norm1: nn.LayerNorm, attn: Attention, norm2: nn.LayerNorm, mlp: nn.Module):
        super().__init__()
        self.norm1 = norm1
        self.attn = attn
        self.norm2 = norm2
        self.mlp = mlp

    def attend(self, x: Tensor) -> Tensor:
        """The attention half, shared by every expert in an MoE block."""
        return x + self.attn(self.norm1(x))

    def forward(self, x: Tensor) -> Tensor:
        x = self.attend(x)
        return x + self.mlp(self.norm2(x))


def layer_norm(cfg: ViTConfig) -> nn.LayerNorm:
    """Every LayerNorm of the model (blocks, head): the config's width and epsilon."""
    return nn.LayerNorm(cfg.width, eps=cfg.norm_eps)


def dense_block(cfg: ViTConfig, mlp_hidden: int | None = None) -> Block:
    return Block(
        layer_norm(cfg),
        Attention(cfg.width, cfg.num_heads),
        layer_norm(cfg),
        Mlp(cfg.width, mlp_hidden or cfg.mlp_hidden),
    )


class TokenEmbedding(nn.Module):
    """(B, C, H, W) -> (B, T, D): patch tokens, the class token under cls pooling, learned position embedding."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.patch_embed = PatchEmbed(cfg)
        # Mean pooling needs no class token (as in big_vision's "gap" ViTs).
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.width)) if cfg.pool == "cls" else None
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_tokens, cfg.width))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)

    def forward(self, images: Tensor) -> Tensor:
        torch._assert(images.dim() == 4, "expected images of shape (B, C, H, W)")
        x = self.patch_embed(images)  # (B, N, D)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, T, D)
        return x + self.pos_embed


def pool_tokens(tokens: Tensor, pool: str) -> Tensor:
    """(B, T, D) -> (B, D): the class token, or the mean of the patch tokens."""
    return tokens[:, 0] if pool == "cls" else tokens.mean(dim=1)


class ClassifierHead(nn.Module):
    """Final LayerNorm, pooling and the linear classifier: tokens (B, T, D) -> logits (B, K)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.pool = cfg.pool
        self.norm = layer_norm(cfg)
        self.fc = nn.Linear(cfg.width, cfg.num_classes)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.fc(pool_tokens(self.norm(tokens), self.pool))


class VisionTransformer(nn.Module):
    """Dense ViT with timm's API: forward_features (tokens) -> forward_head (logits); forward returns a ModelOutput."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.config = cfg
        self.embedding = TokenEmbedding(cfg)
        self.blocks = nn.ModuleList(dense_block(cfg, cfg.mlp_hidden_of(i)) for i in range(cfg.depth))
        self.head = ClassifierHead(cfg)
        self.apply(init_weights)

    def forward_features(self, images: Tensor) -> tuple[Tensor, None]:
        """(B, C, H, W) -> (tokens (B, T, D) before the final norm, routing). Dense models have no routing."""
        x = self.embedding(images)
        for block in self.blocks:
            x = block(x)
        return x, None

    def forward_head(self, tokens: Tensor) -> Tensor:
        return self.head(tokens)

    def forward(self, images: Tensor) -> ModelOutput:
        tokens, routing = self.forward_features(images)
        return ModelOutput(self.forward_head(tokens), routing)

    def dense_key(self, key: str) -> str:
        """Fine-tuning from a dense run (mobile_moe/models/upcycle.py): every entry starts from the entry of its own
        name."""
        return key


def init_weights(module: nn.Module) -> None:
    """timm's ViT init: truncated-normal linears with zero bias; LayerNorm stays at (1, 0). A module that holds its
    linears stacked (moe.StackedModules) has each of them initialised by `init_linear`, through its own init_linears."""
    if isinstance(module, nn.Linear):
        init_linear(module.weight, module.bias)
    elif hasattr(module, "init_linears"):
        module.init_linears(init_linear)


def init_linear(weight: Tensor, bias: Tensor | None) -> None:
    """One linear layer's init (init_weights): weight (out, in) truncated normal, std 0.02; bias zero."""
    nn.init.trunc_normal_(weight, std=0.02)
    if bias is not None:
        nn.init.zeros_(bias)
