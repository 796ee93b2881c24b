"""Model configs: a small dataclass per model family and the paper's size grid as a table.

Pure Python (no torch), so `mobile-moe info` and cost accounting start instantly. Every config validates itself on
construction, so a bad value is caught before any tensor is allocated.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from mobile_moe.errors import UsageError

# Heads per width, as in the paper (Sec. 3.1): width 384 -> 6 heads, 192 -> 3, 96 -> 3, 64 -> 2.
HEADS_FOR_WIDTH = {384: 6, 192: 3, 96: 3, 64: 2}

# Named sizes. `deit-*` are the DeiT models of the paper's ablations (patch 16); `DxW` strings give the grid of Fig. 3a.
PRESETS: dict[str, dict[str, int]] = {
    "deit-ti": {"depth": 12, "width": 192, "num_heads": 3, "patch_size": 16},
    "deit-s": {"depth": 12, "width": 384, "num_heads": 6, "patch_size": 16},
}

POOLS = ("cls", "mean")
# How a model picks experts (a config's `routing`), by what one decision covers: the one owner of that split, for the
# configs' per_image, export's layouts (mobile_moe/export/graphs.py) and training's checks.
PER_IMAGE_ROUTINGS = ("image", "cluster")  # one choice per image: the model splits into a router and expert graphs
PER_TOKEN_ROUTINGS = ("token", "expert", "soft")  # per token (or slot): every expert may run for every image


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


@dataclass
class ViTConfig:
    """A dense Vision Transformer (Dosovitskiy et al.), pre-norm blocks, as in the paper's baselines."""

    image_size: int = 224  # input is image_size x image_size
    patch_size: int = 32  # the paper uses 32 for every model of Fig. 3a (fewer tokens -> fewer FLOPs)
    in_chans: int = 3
    num_classes: int = 1000
    depth: int = 12  # transformer blocks
    width: int = 192  # token embedding size D
    num_heads: int = 3
    mlp_ratio: float = 4.0  # MLP hidden size = mlp_ratio * width
    pool: str = "cls"  # "cls": class token; "mean": mean of patch tokens (no class token)
    norm_eps: float = 1e-5  # every LayerNorm's epsilon; timm and torchvision ViTs use 1e-6 (kept by `import`)
    # The dense baseline of Fig. 3d: the last `wide_mlp_layers` blocks have an MLP `wide_mlp_factor` times as wide,
    # which costs the inference FLOPs of a Mobile V-MoE running k = wide_mlp_factor experts in its last L blocks.
    wide_mlp_layers: int = 0
    wide_mlp_factor: int = 1

    name = "vit"  # registry name; a class attribute, not a field
    model_class = "mobile_moe.models.vit:VisionTransformer"  # "module:Class", imported only when a model is built
    routing = "none"  # how the model picks experts (see MoEConfig); "none" for a dense model
    # Why a dense vit run cannot initialise this model (mobile_moe/models/upcycle.py); None: it can (--init-from; a vit
    # is fine-tuned, an MoE upcycled).
    upcycle_refusal = None

    @property
    def is_moe(self) -> bool:
        return self.routing != "none"

    def __post_init__(self) -> None:
        for field in ("image_size", "patch_size", "in_chans", "num_classes", "depth", "width", "num_heads"):
            value = getattr(self, field)
            _require(isinstance(value, int) and value >= 1, f"{field}={value!r}: must be a positive integer")
        _require(
            isinstance(self.mlp_ratio, int | float) and not isinstance(self.mlp_ratio, bool) and self.mlp_ratio > 0,
            f"mlp_ratio={self.mlp_ratio!r}: must be a positive number",
        )
        _require(
            isinstance(self.norm_eps, float) and 0 < self.norm_eps < 1,
            f"norm_eps={self.norm_eps!r}: must be a float between 0 and 1 (e.g. 1e-6)",
        )
        _require(self.pool in POOLS, f"pool={self.pool!r}: must be one of {', '.join(POOLS)}")
        _require(
            isinstance(self.wide_mlp_layers, int) and 0 <= self.wide_mlp_layers <= self.depth,
            f"wide_mlp_layers={self.wide_mlp_layers!r}: must be between 0 and depth={self.depth}",
        )
        _require(
            isinstance(self.wide_mlp_factor, int) and self.wide_mlp_factor >= 1,
            f"wide_mlp_factor={self.wide_mlp_factor!r}: must be a positive integer",
        )
        _require(
            (self.wide_mlp_layers == 0) == (self.wide_mlp_factor == 1),
            f"wide_mlp_layers={self.wide_mlp_layers} with wide_mlp_factor={self.wide_mlp_factor}: give both (a factor "
            "above 1 for some last layers) or neither",
        )
        _require(
            self.width % self.num_heads == 0,
            f"width={self.width} is not divisible by num_heads={self.num_heads}: pick heads that divide the width",
        )
        _require(
            self.image_size % self.patch_size == 0,
            f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}: "
            f"use a multiple of {self.patch_size}",
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        """Sequence length inside the blocks: patches plus the class token under cls pooling."""
        return self.num_patches + (1 if self.pool == "cls" else 0)

    @property
    def mlp_hidden(self) -> int:
        return int(self.width * self.mlp_ratio)

    def mlp_hidden_of(self, block: int) -> int:
        """MLP hidden size of block `block` (0-based): mlp_hidden, times wide_mlp_factor in the last wide layers."""
        wide = block >= self.depth - self.wide_mlp_layers
        return self.mlp_hidden * (self.wide_mlp_factor if wide else 1)

    def to_dict(self) -> dict[str, Any]:
        """{"name": the registry name, every field}: what config.json's "model" and a checkpoint's "config" hold."""
        return {"name": self.name, **dataclasses.asdict(self)}


@dataclass
class MoEConfig(ViTConfig):
    """Shared by every MoE: E experts in `moe_layers` MoE blocks. Not a model of its own.

    `routing` (a class attribute) says how a model picks experts, which is what the rest of the toolkit asks:
      image    one learned router per image, shared by every MoE block (Mobile V-MoE)
      cluster  one fixed router per image: the nearest k-means centroid of a dense gater's features (Hard MoE)
      token    a router per MoE block that sends each token to its top-k experts, within a buffer capacity
      expert   a router per MoE block where each expert takes its top-C tokens (Experts Choice)
      soft     every expert sees weighted averages of all tokens (Soft MoE); nothing is picked or dropped
    Per-image models split into a router graph and one graph per expert; the others export whole.
    """

    num_experts: int = 10  # E
    moe_layers: int = 2  # L: MoE blocks

    routing = "image"
    min_dense_layers = 1  # dense blocks a model needs before its MoE blocks: a per-image router reads their tokens

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(
            self.wide_mlp_layers == 0,
            f"wide_mlp_layers={self.wide_mlp_layers}: widening MLPs makes a FLOPs-matched dense vit; an MoE adds "
            "experts instead (--top-k)",
        )
        _require(
            isinstance(self.num_experts, int) and self.num_experts >= 2,
            f"num_experts={self.num_experts}: must be at least 2",
        )
        limit = self.depth - self.min_dense_layers
        _require(
            isinstance(self.moe_layers, int) and 1 <= self.moe_layers <= limit,
            f"moe_layers={self.moe_layers}: must be between 1 and {limit}"
            + (" (the router needs at least one dense block before it)" if self.min_dense_layers else ""),
        )

    @property
    def per_image(self) -> bool:
        """One routing decision per image: the model splits into a router and per-expert graphs."""
        return self.routing in PER_IMAGE_ROUTINGS

    @property
    def dense_layers(self) -> int:
        return self.depth - self.moe_layers

    @property
    def expert_sets(self) -> int:
        """How many sets of E experts the model holds: one per MoE block (WideNet's blocks share one set; a Hard MoE
        expert is a whole set of blocks). An image needs (experts it uses in each set) summed over the sets."""
        return self.moe_layers

    def _require_top_k(self) -> None:
        top_k = self.top_k
        _require(
            isinstance(top_k, int) and 1 <= top_k <= self.num_experts,
            f"top_k={top_k}: must be between 1 and num_experts={self.num_experts}",
        )


@dataclass
class MobileVMoEConfig(MoEConfig):
    """Mobile V-MoE (Daxberger et al. 2023): the last `moe_layers` blocks are MoE blocks sharing one image router."""

    top_k: int = 1  # k experts per image
    renormalize_gates: bool = False  # divide the top-k weights by their sum (the paper does not)
    # Early routing: the router reads the tokens after dense block J (1-based) instead of the first MoE block's input
    # (None, the paper's placement). The trunk still runs every dense block; a runner can load the chosen expert
    # while the blocks after J run (export splits them into a trunk-tail graph).
    router_block: int | None = None

    name = "mobile-vmoe"
    model_class = "mobile_moe.models.mobile_vmoe:MobileVMoE"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require_top_k()
        _require(
            self.router_block is None
            or (isinstance(self.router_block, int) and 1 <= self.router_block <= self.dense_layers),
            f"router_block={self.router_block}: the router reads the tokens after dense block J, 1 <= J <= "
            f"{self.dense_layers} (the dense blocks before the MoE blocks), or leave it out (after the last one)",
        )

    @property
    def early_routing(self) -> bool:
        """The router reads the tokens before the last dense block: there is a trunk tail to run after routing."""
        return self.router_block is not None and self.router_block < self.dense_layers


@dataclass
class HardMoEConfig(MoEConfig):
    """Hard MoE (Gross et al. 2017) on our split: the first depth - L blocks are a frozen dense gater whose pooled
    features pick one expert by the nearest k-means centroid (after PCA); an expert is the last L whole blocks and a
    classifier head (or one head shared by every expert, the paper's shared-decoder variant)."""

    top_k: int = 1  # one expert per image, always
    pca_dims: int = 32  # features are projected to this many principal components before k-means; 0: no PCA
    shared_head: bool = False

    name = "hard-moe"
    model_class = "mobile_moe.models.hard_moe:HardMoE"
    routing = "cluster"
    expert_sets = 1  # an expert is the whole set of last L blocks (and its head): one per image

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.top_k == 1, f"top_k={self.top_k}: a Hard MoE sends each image to exactly one expert (top_k 1)")
        _require(
            isinstance(self.pca_dims, int) and 0 <= self.pca_dims <= self.width,
            f"pca_dims={self.pca_dims}: must be between 0 (no PCA) and the width {self.width}",
        )


MOE_PLACEMENTS = ("last", "every-other")


@dataclass
class TokenMoEConfig(MoEConfig):
    """A per-token MoE with its MoE blocks placed "last" (Mobile V-MoE's counterpart) or "every-other" (V-MoE's
    layout: every second block from the second, counted from the end). Not a model of its own."""

    moe_placement: str = "last"

    min_dense_layers = 0
    # The router's linear map has no bias, as the papers' g(x) = TOP_k(softmax(W x)) and google-research/vmoe's dense
    # layer (V-MoE, Experts Choice; Soft MoE's slots are no linear map). A property of the family, not an option.
    router_bias: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.moe_placement in MOE_PLACEMENTS, f"moe_placement={self.moe_placement!r}: choose one of "
                 f"{', '.join(MOE_PLACEMENTS)}")  # fmt: skip
        if self.moe_placement == "every-other":
            _require(
                2 * self.moe_layers <= self.depth,
                f"moe_layers={self.moe_layers} every other block needs depth >= {2 * self.moe_layers} "
                f"(depth is {self.depth})",
            )

    @property
    def moe_block_indices(self) -> list[int]:
        """Which of the depth blocks are MoE blocks."""
        if self.moe_placement == "last":
            return list(range(self.depth - self.moe_layers, self.depth))
        return list(range(self.depth - 1, self.depth - 1 - 2 * self.moe_layers, -2))[::-1]


def _require_noise(cfg: MoEConfig) -> None:
    noise = cfg.noise_std
    _require(
        noise is None or (isinstance(noise, (int, float)) and 0 <= noise < float("inf")),
        f"noise_std={noise!r}: must be a finite number >= 0 (or null for 1 / num_experts)",
    )


def _require_token_choice(cfg: VMoEConfig | WideNetConfig) -> None:
    """The options V-MoE's and WideNet's token-choice routers share: top_k, capacity, noise, auxiliary loss."""
    cfg._require_top_k()
    _require_capacity(cfg)
    _require_noise(cfg)
    _require(0 <= cfg.aux_loss_weight < float("inf"), f"aux_loss_weight={cfg.aux_loss_weight}: must be >= 0")


def _router_noise_std(cfg: MoEConfig) -> float:
    """The std of the noise a per-token router adds to its logits while training: noise_std, or 1 / E by default."""
    return 1.0 / cfg.num_experts if cfg.noise_std is None else float(cfg.noise_std)


def _require_capacity(cfg: TokenMoEConfig) -> None:
    for field in ("capacity_ratio", "eval_capacity_ratio"):
        value = getattr(cfg, field)
        finite = isinstance(value, (int, float)) and 0 < value < float("inf")
        _require(finite, f"{field}={value!r}: must be a positive number")


def _require_routing_group(cfg: VMoEConfig | ExpertsChoiceConfig) -> None:
    """routing_group_images: while training, the tokens of this many consecutive images of a batch compete for one
    set of expert buffers (capacity counted over the group, BPR ranking the group's tokens), as google-research/vmoe
    routes groups of images; the batch each process trains on must be a multiple of it. Evaluation and exported
    graphs always route each image alone, so an image's output never depends on the batch it came in. 1: per image."""
    group = cfg.routing_group_images
    _require(isinstance(group, int) and group >= 1, f"routing_group_images={group!r}: must be an integer >= 1")


@dataclass
class VMoEConfig(TokenMoEConfig):
    """V-MoE (Riquelme et al. 2021): each MoE block has its own router sending every token to its top-k experts,
    with noisy gates, a buffer capacity per expert and Batch Prioritized Routing; importance and load losses."""

    top_k: int = 2
    capacity_ratio: float = 1.05  # C while training: each expert takes ceil(C * k * T / E) tokens of an image
    eval_capacity_ratio: float = 4.0  # C at evaluation and in exported graphs
    noise_std: float | None = None  # std of the noise added to the router logits while training; None: 1 / E
    batch_prioritized: bool = True  # tokens with the highest top gate fill the buffers first (BPR)
    aux_loss_weight: float = 0.01  # weight of (importance loss + load loss) / 2, summed over MoE blocks
    routing_group_images: int = 1  # see _require_routing_group

    name = "vmoe"
    model_class = "mobile_moe.models.token_moe:TokenMoEViT"
    routing = "token"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_token_choice(self)
        _require_routing_group(self)

    @property
    def router_noise_std(self) -> float:
        return _router_noise_std(self)


@dataclass
class ExpertsChoiceConfig(TokenMoEConfig):
    """Experts Choice (Zhou et al. 2022): each expert takes its top-C tokens of an image, C = ceil(c * T / E) with c
    the capacity ratio (tokens per expert relative to an even split); no token-side top-k, no auxiliary loss."""

    capacity_ratio: float = 2.0
    eval_capacity_ratio: float = 2.0
    routing_group_images: int = 1  # see _require_routing_group

    name = "experts-choice"
    model_class = "mobile_moe.models.token_moe:TokenMoEViT"
    routing = "expert"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_capacity(self)
        _require_routing_group(self)


@dataclass
class SoftMoEConfig(TokenMoEConfig):
    """Soft MoE (Puigcerver et al. 2023): each expert processes `slots_per_expert` slots, each slot a softmax-weighted
    average of all tokens; each token's output is a softmax-weighted average of all slot outputs."""

    slots_per_expert: int = 1

    name = "soft-moe"
    model_class = "mobile_moe.models.token_moe:TokenMoEViT"
    routing = "soft"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(
            isinstance(self.slots_per_expert, int) and self.slots_per_expert >= 1,
            f"slots_per_expert={self.slots_per_expert}: must be at least 1",
        )


@dataclass
class WideNetConfig(MoEConfig):
    """WideNet (Xue et al. 2021): ONE attention and ONE per-token MoE layer (top-k, capacity, load-balancing loss)
    shared by every block; each block keeps its own two LayerNorms. Every block is an MoE block (moe_layers = depth)."""

    num_experts: int = 4
    moe_layers: int = 0  # always depth; 0 means "every block" and is filled in
    top_k: int = 2
    capacity_ratio: float = 1.2  # the paper's C
    eval_capacity_ratio: float = 2.0
    noise_std: float | None = None  # router noise while training (Eq. 2: N(0, 1/E^2)); None: 1 / E
    aux_loss_weight: float = 0.01  # Switch-style load-balancing loss, summed over blocks

    router_bias: ClassVar[bool] = True  # WideNet's router keeps its bias (a Switch router's dense layer)
    name = "widenet"
    model_class = "mobile_moe.models.widenet:WideNet"
    routing = "token"
    upcycle_refusal = "widenet's blocks share ONE attention and MoE layer, where a dense vit has one per block"
    expert_sets = 1  # every block uses the same E experts
    min_dense_layers = 0

    def __post_init__(self) -> None:
        if self.moe_layers == 0:
            self.moe_layers = self.depth
        super().__post_init__()
        _require(
            self.moe_layers == self.depth,
            f"moe_layers={self.moe_layers}: every WideNet block shares the one MoE layer (leave --moe-layers out)",
        )
        _require_token_choice(self)

    @property
    def router_noise_std(self) -> float:
        return _router_noise_std(self)


HEAD_DIMS = (64, 32, 16, 8)  # off the paper's grid: the widest of these head sizes that divides the width


def parse_size(size: str) -> dict[str, int]:
    """`deit-ti` / `deit-s`, or `DxW` -> config fields. On the paper's grid (W in 384, 192, 96, 64) the heads are the
    paper's; any other width gets W / d heads, d the widest of 64, 32, 16, 8 that divides it (48 -> 3 heads of 16)."""
    if size in PRESETS:
        return dict(PRESETS[size])
    match = re.fullmatch(r"(\d+)x(\d+)", size)
    _require(
        match is not None,
        f"size {size!r}: use DEPTHxWIDTH (e.g. 12x192) or a preset ({', '.join(PRESETS)})",
    )
    depth, width = int(match.group(1)), int(match.group(2))
    if width in HEADS_FOR_WIDTH:
        return {"depth": depth, "width": width, "num_heads": HEADS_FOR_WIDTH[width]}
    head_dim = next((d for d in HEAD_DIMS if width % d == 0), None)
    _require(
        head_dim is not None and width > 0,
        f"size {size!r}: width {width} splits into no heads of {', '.join(map(str, HEAD_DIMS))}; use a multiple of 8 "
        f"(the paper's grid: {', '.join(map(str, HEADS_FOR_WIDTH))})",
    )
    return {"depth": depth, "width": width, "num_heads": width // head_dim}
