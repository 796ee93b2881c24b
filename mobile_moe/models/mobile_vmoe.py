"""Mobile V-MoE (Daxberger et al. 2023): a ViT whose last L blocks are MoE blocks sharing ONE per-image router.

    images -> [RouterStage: embedding, depth-L dense blocks, router] -> tokens, routing
              (the router reads the tokens after dense block router_block; the last one by default)
           -> [L MoE blocks, each using the same chosen experts] -> head -> logits

The router stage and each expert's path are modules of their own (router_stage(), expert_path(e)) that share the
model's parameters, so mobile_moe/export/ lifts them into separate graphs without copying code: a phone then holds the
router and only the experts it picks. Legend: B images, T tokens, D width, E experts, k experts per image, K classes.
"""

from __future__ import annotations

from torch import Tensor, nn

from mobile_moe.models.config import MobileVMoEConfig
from mobile_moe.models.moe import moe_block
from mobile_moe.models.routers import PerImageRouter
from mobile_moe.models.upcycle import block_entry
from mobile_moe.models.vit import Block, ClassifierHead, TokenEmbedding, dense_block, init_weights
from mobile_moe.utils.outputs import ModelOutput, Routing


class RouterStage(nn.Module):
    """images (B, C, H, W) -> (tokens (B, T, D) after the dense blocks, Routing).

    The router reads the tokens after the first `router_block` dense blocks (all of them by default, the paper's
    placement): route() is the trunk up to there and the routing, tail() the dense blocks after it. With early
    routing the decision is known while the tail still runs, so a runner can load the expert meanwhile.
    """

    def __init__(
        self, embedding: TokenEmbedding, blocks: nn.ModuleList, router: nn.Module, router_block: int | None = None
    ):
        super().__init__()
        self.embedding = embedding
        self.blocks = blocks
        self.router = router
        self.router_block = len(blocks) if router_block is None else router_block

    def route(self, images: Tensor, route_to: Tensor | None = None) -> tuple[Tensor, Routing]:
        x = self.embedding(images)  # (B, T, D)
        for block in self.blocks[: self.router_block]:
            x = block(x)
        return x, self.router(x, route_to)

    def tail(self, tokens: Tensor) -> Tensor:
        for block in self.blocks[self.router_block :]:
            tokens = block(tokens)
        return tokens

    def forward(self, images: Tensor, route_to: Tensor | None = None) -> tuple[Tensor, Routing]:
        tokens, routing = self.route(images, route_to)
        return self.tail(tokens), routing


class ExpertPath(nn.Module):
    """(tokens (B, T, D), gate (B, 1)) -> logits (B, K) for images routed to one expert (k = 1).

    Holds that expert's MLP in every MoE block, the blocks' shared attention and norms, and the head: exactly the
    weights one image needs after the router. The gate scales the expert's output in each block, as in the model.
    """

    def __init__(self, blocks: list[Block], head: ClassifierHead, expert: int):
        super().__init__()
        self.expert = expert
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, tokens: Tensor, gate: Tensor) -> Tensor:
        gate = gate.reshape(-1, 1, 1).to(tokens.dtype)  # (B, 1, 1)
        x = tokens
        for block in self.blocks:
            x = block.attend(x)
            x = x + gate * block.mlp(block.norm2(x))
        return self.head(x)


class MobileVMoE(nn.Module):
    """The whole model; training and evaluation call it, export splits it."""

    def __init__(self, cfg: MobileVMoEConfig):
        super().__init__()
        self.config = cfg
        router = PerImageRouter(cfg.width, cfg.num_experts, cfg.top_k, cfg.pool, cfg.renormalize_gates)
        dense_blocks = nn.ModuleList(dense_block(cfg) for _ in range(cfg.dense_layers))
        self.router_stage = RouterStage(TokenEmbedding(cfg), dense_blocks, router, cfg.router_block)
        self.moe_blocks = nn.ModuleList(moe_block(cfg, cfg.num_experts) for _ in range(cfg.moe_layers))
        self.head = ClassifierHead(cfg)
        self.apply(init_weights)

    @property
    def router(self) -> PerImageRouter:
        return self.router_stage.router

    def forward_features(
        self, images: Tensor, route_to: Tensor | None = None, dispatch: str = "grouped"
    ) -> tuple[Tensor, Routing]:
        """(B, C, H, W) -> (tokens (B, T, D) before the final norm, Routing). One decision serves all MoE blocks.

        The one place the MoE composition is written. Options, not copies of it: route_to (B,) routes each image to
        that expert first (label routing while training, see PerImageRouter); dispatch "dense" runs every expert on
        every image weighted by the sparse gates (the single-graph export, see ExpertMLPs).
        """
        x, routing = self.router_stage(images, route_to)
        if dispatch != "grouped":
            for block in self.moe_blocks:
                x = block(x, routing, dispatch)
            return x, routing
        # One grouping of the images by expert for all MoE blocks: the routing is the same in each. With k = 1 the
        # blocks run on the batch sorted by expert (attention is per image, so the order does not matter to it): one
        # gather here and one after the last block, instead of a gather and a scatter in every block.
        groups = self.moe_blocks[0].mlp.groups(x, routing.experts, routing.gates, sort_stream=True)
        x = groups.to_stream(x)
        for block in self.moe_blocks:
            x = block(x, routing, dispatch, groups)
        return groups.from_stream(x), routing

    def forward_head(self, tokens: Tensor) -> Tensor:
        return self.head(tokens)

    def forward(self, images: Tensor, route_to: Tensor | None = None, dispatch: str = "grouped") -> ModelOutput:
        tokens, routing = self.forward_features(images, route_to, dispatch)
        return ModelOutput(self.forward_head(tokens), routing)

    def dense_key(self, key: str) -> str | None:
        """Upcycling (mobile_moe/models/upcycle.py): the dense vit entry `key` starts from; None for the fresh
        router."""
        part, _, rest = key.partition(".")
        if part == "router_stage":
            return None if rest.startswith("router.") else rest  # embedding.*, blocks.<i>.*: the same names
        if part == "moe_blocks":
            index, _, rest = rest.partition(".")
            return block_entry(rest, self.config.dense_layers + int(index))
        return key  # head.*

    # --- the split, for export ------------------------------------------------------------------------------------

    def expert_path(self, expert: int) -> ExpertPath:
        """Expert `expert`'s path through all MoE blocks and the head, sharing this model's parameters."""
        if not 0 <= expert < self.config.num_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.config.num_experts - 1}")
        blocks = [block.with_expert(expert) for block in self.moe_blocks]
        return ExpertPath(blocks, self.head, expert)
