"""The cells of each figure: which models are trained, how, and which dense model each is compared with.

A cell is one model of a figure, trained once per seed as an ordinary run directory (DIR/runs/CELL/seed-S). Cell
names say what was trained in the paper's terms, so figures that share a model share its runs: Fig. 1 and Fig. 3a are
one grid; the DeiT-Ti dense model is Fig. 3b/3c's baseline, Fig. 3d's k=1 dense model and every ablation's source of
super-classes; Fig. 3d's k=2 MoE is Fig. 3e's super-class routing.

    from mobile_moe.evidence.figures import figure
    fig = figure("fig3e", scale("tiny"), num_classes=10)
    [cell.name for cell in fig.cells]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mobile_moe.errors import UsageError
from mobile_moe.evidence import paper
from mobile_moe.evidence.scales import PAPER_DEPTHS, PAPER_WIDTHS, Backbone, Scale
from mobile_moe.models.config import ViTConfig
from mobile_moe.models.registry import make_config
from mobile_moe.training.recipes import recipe

FIGURES = ("fig1", "fig3a", "fig3b", "fig3c", "fig3d", "fig3e")
DERIVED = "derived"  # super-classes clustered from the figure's source dense model (Sec. 2.2)
RANDOM_SUPER_CLASSES = "random:0"  # Fig. 3e's baseline: the same number of super-classes, classes assigned at random
COARSE = "coarse"  # the data's own super-classes (not in the paper): Fig. 3e's extra row where the data has them
ABLATION = {"num_experts": 10, "top_k": 1, "moe_layers": 2}  # the paper's defaults for Fig. 3b-e


@dataclass
class Cell:
    name: str  # directory name under DIR/runs, unique across figures
    row: str  # the table row it belongs to, in the paper's terms: "12x384", "E=5", "k=2", "super-class"
    role: str  # "dense" | "moe"
    backbone: Backbone  # what we train in the paper's model's place
    recipe: str
    config: ViTConfig | None  # None when the cell cannot run here (see skip)
    super_classes: str | None = None  # DERIVED, RANDOM_SUPER_CLASSES or None
    recipe_changes: dict[str, Any] = field(default_factory=dict)
    baseline: str | None = None  # the dense cell its delta is measured against
    paper: dict[str, float] = field(default_factory=dict)  # the paper's numbers for this cell
    skip: str | None = None  # why the cell cannot run on this data or scale

    @property
    def num_experts(self) -> int | None:
        return getattr(self.config, "num_experts", None)


@dataclass
class Figure:
    name: str
    title: str
    layout: str  # "pairs": a dense and an MoE cell per row (Fig. 1, 3a, 3d); "rows": a cell per row (3b, 3c, 3e)
    cells: list[Cell]
    source: str  # the dense cell whose seed-0 run's confusion matrix gives the super-classes

    def cell(self, name: str) -> Cell:
        return next(cell for cell in self.cells if cell.name == name)


def _config(model: str, backbone: Backbone, scale: Scale, num_classes: int, **fields: Any) -> ViTConfig:
    return make_config(model, None, **backbone.fields(), image_size=scale.image_size, pool=scale.pool,
                       num_classes=num_classes, **fields)  # fmt: skip


def _cell(name: str, row: str, role: str, model: str, backbone: Backbone, scale: Scale, recipe: str,
          num_classes: int, fields: dict[str, Any] | None = None, **extra: Any) -> Cell:  # fmt: skip
    """A cell; one whose model is impossible here (more super-classes than classes, L beyond the backbone's depth)
    carries the reason instead of a config, so the sweep goes on and the table says why."""
    fields = fields or {}
    skip, config = None, None
    experts = fields.get("num_experts")
    if extra.get("super_classes") and experts is not None and experts > num_classes:
        skip = f"{experts} super-classes need at least {experts} classes; the data has {num_classes}"
    else:
        try:
            config = _config(model, backbone, scale, num_classes, **fields)
        except UsageError as error:
            skip = f"not possible at this scale: {error}"
    return Cell(name, row, role, backbone, recipe, config, skip=skip, **extra)


def fig3a(scale: Scale, num_classes: int) -> Figure:
    """Dense ViTs vs Mobile V-MoEs (E=10, k=1, L=2) over the paper's 3 depths x 4 widths, patch 32 (Fig. 1, 3a)."""
    cells = []
    for width in PAPER_WIDTHS:
        for depth in PAPER_DEPTHS:
            row, backbone, recipe = f"{depth}x{width}", scale.grid_backbone(depth, width), scale.recipe_for(width)
            mflops, dense_top1, moe_top1 = paper.FIG3A[(depth, width)]
            dense = f"{row}-dense"
            common = (backbone, scale, recipe, num_classes)
            cells.append(_cell(dense, row, "dense", "vit", *common, paper={"mflops": mflops, "top1": dense_top1}))
            cells.append(_cell(f"{row}-moe", row, "moe", "mobile-vmoe", *common, ABLATION, super_classes=DERIVED,
                               baseline=dense, paper={"mflops": mflops, "top1": moe_top1,
                                                      "delta": round(moe_top1 - dense_top1, 2)}))  # fmt: skip
    source = f"{PAPER_DEPTHS[0]}x{PAPER_WIDTHS[0]}-dense"  # the largest dense model (the paper used a ViT-S/16)
    return Figure("fig3a", "Accuracy vs. efficiency across ViT scales", "pairs", cells, source)


def fig1(scale: Scale, num_classes: int) -> Figure:
    fig = fig3a(scale, num_classes)
    return Figure("fig1", "Accuracy vs. FLOPs for ViTs of different sizes", "pairs", fig.cells, fig.source)


# --- the ablations (Fig. 3b-e): DeiT-Ti/16 with E=10, k=1, L=2 unless varied -------------------------------------

DENSE = "deit-ti-dense"


def _dense(scale: Scale, num_classes: int, row: str = "dense", paper_numbers: dict | None = None) -> Cell:
    return _cell(DENSE, row, "dense", "vit", scale.ablation, scale, scale.recipe_for(192), num_classes,
                 paper=paper_numbers or {})  # fmt: skip


def _moe(scale: Scale, num_classes: int, row: str, baseline: str = DENSE, name: str | None = None,
         model: str = "mobile-vmoe", super_classes: str | None = DERIVED, paper_numbers: dict | None = None,
         recipe_changes: dict | None = None, **fields: Any) -> Cell:  # fmt: skip
    moe = {**ABLATION, **fields}
    name = name or f"deit-ti-moe-E{moe['num_experts']}-k{moe['top_k']}-L{moe['moe_layers']}"
    return _cell(name, row, "moe", model, scale.ablation, scale, scale.recipe_for(192), num_classes, moe,
                 super_classes=super_classes, baseline=baseline, paper=paper_numbers or {},
                 recipe_changes=recipe_changes or {})  # fmt: skip


def fig3b(scale: Scale, num_classes: int) -> Figure:
    """Total number of experts E (and of super-classes) in {5, 7, 10, 15, 20}."""
    cells = [_dense(scale, num_classes, paper_numbers={"top1": paper.ABLATION_DENSE})]
    for experts, (router, top1, delta) in paper.FIG3B.items():
        numbers = {"router": router, "top1": top1, "delta": delta}
        cells.append(_moe(scale, num_classes, f"E={experts}", paper_numbers=numbers, num_experts=experts))
    return Figure("fig3b", "Total number of experts E", "rows", cells, DENSE)


def fig3c(scale: Scale, num_classes: int) -> Figure:
    """Number of MoE layers L in {1, ..., 5} (the paper's numbers where it tried that L: 1, 2, 4)."""
    cells = [_dense(scale, num_classes, paper_numbers={"top1": paper.ABLATION_DENSE})]
    for layers in range(1, 6):
        router, top1, delta = paper.FIG3C.get(layers, (None, None, None))
        numbers = {} if top1 is None else {"router": router, "top1": top1, "delta": delta}
        cells.append(_moe(scale, num_classes, f"L={layers}", paper_numbers=numbers, moe_layers=layers))
    return Figure("fig3c", "Number of MoE layers L", "rows", cells, DENSE)


def _matched_dense(scale: Scale, num_classes: int, top_k: int, paper_numbers: dict, row: str | None = None) -> Cell:
    """The dense model with a k-expert MoE's inference FLOPs: its last L MLPs k times as wide (k = 1: plain)."""
    row = row or f"k={top_k}"
    if top_k == 1:
        return _dense(scale, num_classes, row, paper_numbers)
    wide = {"wide_mlp_layers": ABLATION["moe_layers"], "wide_mlp_factor": top_k}
    return _cell(f"{DENSE}-k{top_k}", row, "dense", "vit", scale.ablation, scale, scale.recipe_for(192),
                 num_classes, wide, paper=paper_numbers)  # fmt: skip


def fig3d(scale: Scale, num_classes: int) -> Figure:
    """Number of experts per image k in {1, 2, 3, 5, 10}, each against the dense model of matched FLOPs."""
    cells = []
    for top_k, (mflops, dense_top1, moe_top1) in paper.FIG3D.items():
        dense = _matched_dense(scale, num_classes, top_k, {"mflops": mflops, "top1": dense_top1})
        numbers = {"mflops": mflops, "top1": moe_top1, "delta": round(moe_top1 - dense_top1, 2)}
        cells += [dense, _moe(scale, num_classes, f"k={top_k}", dense.name, paper_numbers=numbers, top_k=top_k)]
    return Figure("fig3d", "Number of experts k per image", "pairs", cells, DENSE)


def fig3e(scale: Scale, num_classes: int, data_super_classes: int | None = None, experts: int | None = None) -> Figure:
    """Routing strategies at k=2: super-class per-image routing (ours) vs random super-classes, end-to-end learned
    per-image routing (no router loss; Switch balancing instead) and learned per-token routing (V-MoE), all with
    `experts` experts (the paper's 10 when None). Data that brings its own super-classes (`data_super_classes` groups:
    digits-pairs' tens digit, Fashion-MNIST's kinds, CIFAR-100's coarse labels) adds a row routed by them, with E =
    that number: a human grouping beside the derived one. At E >= the data's classes every class is its own
    super-class, derived or random alike: such data needs a smaller `experts` for that comparison."""
    numbers = {name: {"top1": top1, "delta": round(top1 - paper.FIG3E["dense"], 2)} for name, top1 in
               paper.FIG3E.items()}  # fmt: skip
    dense = _matched_dense(scale, num_classes, 2, {"top1": paper.FIG3E["dense"]}, row="dense")
    experts = experts or ABLATION["num_experts"]
    k2 = {"baseline": dense.name, "top_k": 2}
    routed = {"num_experts": experts, **k2}
    cells = [
        dense,
        _moe(scale, num_classes, "super-class", paper_numbers=numbers["super-class"], **routed),
        _moe(scale, num_classes, "random", name=f"deit-ti-random-E{experts}-k2-L2", super_classes=RANDOM_SUPER_CLASSES,
             paper_numbers=numbers["random"], **routed),
        _moe(scale, num_classes, "e2e-image", name=f"deit-ti-e2e-image-E{experts}-k2-L2", super_classes=None,
             recipe_changes={"router_loss_weight": 0.0, "balance_loss_weight": 0.01},
             paper_numbers=numbers["e2e-image"], **routed),
        _moe(scale, num_classes, "e2e-token", name=f"deit-ti-e2e-token-E{experts}-k2-L2", model="vmoe",
             super_classes=None, paper_numbers=numbers["e2e-token"], **routed),
        _dense(scale, num_classes, "super-class source (k=1 dense)"),
    ]  # fmt: skip
    if data_super_classes is not None:
        cells.insert(3, _moe(scale, num_classes, "coarse", name=f"deit-ti-coarse-E{data_super_classes}-k2-L2",
                             super_classes=COARSE, num_experts=data_super_classes, **k2))  # fmt: skip
    return Figure("fig3e", "Routing strategies (k=2)", "rows", cells, DENSE)


BUILDERS = {"fig1": fig1, "fig3a": fig3a, "fig3b": fig3b, "fig3c": fig3c, "fig3d": fig3d, "fig3e": fig3e}

# How each fig3e row routes, for its table
ROUTING_OF_ROW = {
    "dense": ("N/A (dense, k=2 FLOPs)", "-"),
    "super-class": ("super-class", "image"),
    "random": ("random super-class", "image"),
    "coarse": ("the data's coarse labels (not in the paper)", "image"),
    "e2e-image": ("end-to-end", "image"),
    "e2e-token": ("end-to-end", "token"),
    "super-class source (k=1 dense)": ("N/A (dense, k=1: super-class source)", "-"),
}


def cell_recipes(fig: Figure, scale: Scale, epochs: int | None, device: str) -> dict[str, dict[str, Any]]:
    """Each runnable cell's TrainConfig as a dict (without the seed): its recipe at the scale's epochs (or `epochs`)
    and batch size, with the cell's own changes (e.g. no router loss for end-to-end routing)."""
    recipes = {}
    for cell in fig.cells:
        if cell.skip is None:
            changes = {"epochs": epochs or scale.epochs, "device": device, **cell.recipe_changes}
            if scale.batch_size is not None:
                changes["batch_size"] = scale.batch_size
            recipes[cell.name] = recipe(cell.recipe).replace(**changes).to_dict()
    return recipes


def figure(name: str, scale: Scale, num_classes: int, data_super_classes: int | None = None,
           experts: int | None = None) -> Figure:  # fmt: skip
    """`name`'s cells for data of `num_classes` classes; `data_super_classes`: how many super-classes the data brings
    (None: none), for Fig. 3e's coarse row; `experts`: Fig. 3e's E (None: the paper's 10)."""
    if name not in BUILDERS:
        raise UsageError(f"unknown figure {name!r}: choose one of {', '.join(FIGURES)}")
    if experts is not None and name != "fig3e":
        raise UsageError(f"--experts is fig3e's (its routing strategies at E experts); {name} keeps the paper's E")
    if name == "fig3e":
        return fig3e(scale, num_classes, data_super_classes, experts)
    return BUILDERS[name](scale, num_classes)
