"""How big a reproduction is: the paper's settings, or the same grid shrunk for a workstation or a 2-core laptop.

Every scale keeps the paper's structure (three depths x four widths for Fig. 3a, a 12-layer-like ablation backbone
with E=10, k=1, L=2 for Fig. 3b-e) and shrinks image size, width, depth and epochs; a table row always names the
paper's model and the model we trained in its place.
"""

from __future__ import annotations

from dataclasses import dataclass

from mobile_moe.errors import UsageError

PAPER_DEPTHS = (12, 9, 6)  # Fig. 3a's rows, deepest first
PAPER_WIDTHS = (384, 192, 96, 64)
HEADS = (6, 3, 3, 2)  # heads for each of the four widths, at every scale (Sec. 3.1)


@dataclass(frozen=True)
class Backbone:
    depth: int
    width: int
    num_heads: int
    patch_size: int

    @property
    def size(self) -> str:
        return f"{self.depth}x{self.width}/{self.patch_size}"

    def fields(self) -> dict[str, int]:
        return {"depth": self.depth, "width": self.width, "num_heads": self.num_heads, "patch_size": self.patch_size}


@dataclass(frozen=True)
class Scale:
    name: str
    image_size: int
    pool: str  # "cls" as the paper; "mean" learns a tiny dataset in fewer epochs
    epochs: int
    batch_size: int | None  # global batch; None keeps the recipe's
    depths: tuple[int, ...]  # stand-ins for PAPER_DEPTHS
    widths: tuple[int, ...]  # stand-ins for PAPER_WIDTHS
    grid_patch: int  # Fig. 3a's patch (the paper: 32)
    ablation: Backbone  # stands in for DeiT-Ti/16 in Fig. 3b-e
    recipe: str | None = None  # every cell's recipe; None: the paper's, by width (recipe_for)

    def grid_backbone(self, paper_depth: int, paper_width: int) -> Backbone:
        """Our model in the place of the paper's `paper_depth` x `paper_width` of Fig. 3a."""
        column = PAPER_WIDTHS.index(paper_width)
        return Backbone(self.depths[PAPER_DEPTHS.index(paper_depth)], self.widths[column], HEADS[column],
                        self.grid_patch)  # fmt: skip

    def recipe_for(self, paper_width: int) -> str:
        """The paper trains widths 384 and 192 with DeiT's recipe and 96 and 64 with ViT's lighter one (they underfit
        under DeiT's augmentation); the tiny scales train digits-sized data with their own recipe throughout."""
        if self.recipe is not None:
            return self.recipe
        return "deit" if paper_width >= 192 else "vit"


SCALES: dict[str, Scale] = {
    # ImageNet-size images and 300-epoch recipes: a GPU cluster's job (e.g. --launcher submitit --gpus-per-cell 8).
    "paper": Scale("paper", 224, "cls", 300, None, PAPER_DEPTHS, PAPER_WIDTHS, 32, Backbone(12, 192, 3, 16)),
    # CIFAR-size images (32 px, patch 4: 64 tokens, about the paper's 49), the paper's widths and depths, 100 epochs:
    # a workstation GPU.
    "small": Scale("small", 32, "cls", 100, 256, PAPER_DEPTHS, PAPER_WIDTHS, 4, Backbone(12, 192, 3, 4)),
    # 32 px in 8 px patches (16 tokens), widths and depths in the paper's ratios (6 : 3 : 1.5 : 1 and 4 : 3 : 2): this
    # 2-core machine, on digits.
    "tiny": Scale("tiny", 32, "mean", 20, None, (8, 6, 4), (96, 48, 24, 16), 8, Backbone(6, 64, 2, 8), "tiny"),
    # The tiny scale's models in batches of 1,024 (the tiny-gpu recipe): one GPU, on all 54,000 training images of
    # Fashion-MNIST, several runs side by side (reproduce --jobs).
    "tiny-gpu": Scale(
        "tiny-gpu", 32, "mean", 10, None, (8, 6, 4), (96, 48, 24, 16), 8, Backbone(6, 64, 2, 8), "tiny-gpu"
    ),
}


def scale(name: str) -> Scale:
    if name not in SCALES:
        raise UsageError(f"unknown scale {name!r}: choose one of {', '.join(SCALES)}")
    return SCALES[name]
