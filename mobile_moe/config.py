"""Model configs: a small dataclass per model family and the paper's size grid as a table.

Pure Python (no torch), so `mobile-moe info` and cost accounting start instantly. Every config validates itself on
construction, so a bad value is caught before any tensor is allocated.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from mobile_moe.errors import UsageError

# Heads per width, as in the paper (Sec. 3.1): width 384 -> 6 heads, 192 -> 3, 96 -> 3, 64 -> 2.
HEADS_FOR_WIDTH = {384: 6, 192: 3, 96: 3, 64: 2}

# Named sizes. `deit-*` are the DeiT models of the paper's ablations (patch 16); `DxW` strings give the grid of Fig. 3a.
PRESETS: dict[str, dict[str, int]] = {
    "deit-ti": {"depth": 12, "width": 192, "num_heads": 3, "patch_size": 16},
    "deit-s": {"depth": 12, "width": 384, "num_heads": 6, "patch_size": 16},
}

POOLS = ("cls", "mean")


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

    name = "vit"  # registry name; a class attribute, not a field

    def __post_init__(self) -> None:
        for field in ("image_size", "patch_size", "in_chans", "num_classes", "depth", "width", "num_heads"):
            value = getattr(self, field)
            _require(isinstance(value, int) and value >= 1, f"{field}={value!r}: must be a positive integer")
        _require(self.mlp_ratio > 0, f"mlp_ratio={self.mlp_ratio}: must be positive")
        _require(self.pool in POOLS, f"pool={self.pool!r}: must be one of {', '.join(POOLS)}")
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

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **dataclasses.asdict(self)}


@dataclass
class MobileVMoEConfig(ViTConfig):
    """Mobile V-MoE (Daxberger et al. 2023): the last `moe_layers` blocks are MoE blocks sharing one image router."""

    num_experts: int = 10  # E
    top_k: int = 1  # k experts per image
    moe_layers: int = 2  # L: MoE blocks at the end; the first depth - L blocks are dense and feed the router
    renormalize_gates: bool = False  # divide the top-k weights by their sum (the paper does not)

    name = "mobile-vmoe"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.num_experts >= 2, f"num_experts={self.num_experts}: must be at least 2")
        _require(
            1 <= self.top_k <= self.num_experts,
            f"top_k={self.top_k}: must be between 1 and num_experts={self.num_experts}",
        )
        _require(
            1 <= self.moe_layers < self.depth,
            f"moe_layers={self.moe_layers}: must be between 1 and depth-1={self.depth - 1} "
            "(the router needs at least one dense block before it)",
        )

    @property
    def dense_layers(self) -> int:
        return self.depth - self.moe_layers


CONFIGS: dict[str, type[ViTConfig]] = {cls.name: cls for cls in (ViTConfig, MobileVMoEConfig)}


def parse_size(size: str) -> dict[str, int]:
    """`deit-ti` / `deit-s`, or `DxW` from the paper's grid (heads follow the width) -> config fields."""
    if size in PRESETS:
        return dict(PRESETS[size])
    match = re.fullmatch(r"(\d+)x(\d+)", size)
    _require(
        match is not None,
        f"size {size!r}: use DEPTHxWIDTH (e.g. 12x192) or a preset ({', '.join(PRESETS)})",
    )
    depth, width = int(match.group(1)), int(match.group(2))
    _require(
        width in HEADS_FOR_WIDTH,
        f"size {size!r}: width {width} is not in the paper's grid; use one of {', '.join(map(str, HEADS_FOR_WIDTH))}",
    )
    return {"depth": depth, "width": width, "num_heads": HEADS_FOR_WIDTH[width]}


def make_config(name: str, size: str | None = None, **overrides: Any) -> ViTConfig:
    """The config of registered model `name` at `size`, with field overrides (None values are ignored)."""
    _require(name in CONFIGS, f"unknown model {name!r}: choose one of {', '.join(CONFIGS)}")
    cls = CONFIGS[name]
    fields = parse_size(size) if size is not None else {}
    fields.update({key: value for key, value in overrides.items() if value is not None})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    _require(not unknown, f"model {name!r} has no option {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**fields)


def config_from_dict(data: dict[str, Any]) -> ViTConfig:
    """Inverse of `to_dict`: rebuilds the config (and so the model) from a checkpoint's `config` entry."""
    data = dict(data)
    name = data.pop("name", None)
    _require(name in CONFIGS, f"config names unknown model {name!r}: expected one of {', '.join(CONFIGS)}")
    return make_config(name, **data)
