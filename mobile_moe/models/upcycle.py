"""Sparse upcycling (Komatsuzaki et al. 2022): an MoE starts from a trained dense ViT of the same size; and
fine-tuning, its dense case: a vit starts from one (every entry keeps its name).

The embedding, the dense blocks, the MoE blocks' attention and norms and the head are copied; EVERY expert's MLP is
a copy of the dense MLP of its block; a router starts fresh (keeps its own initialisation). Each MoE model says where
each of its state-dict entries comes from (`dense_key(key)`: a dense `vit` key, or None for fresh); `upcycle` is the
one function that applies it. A Mobile V-MoE whose gates sum to 1 (renormalize_gates, or k = 1 after renormalising)
then computes the dense model's function exactly at step 0: its experts are identical, so any mixture of them is the
dense MLP. So does a Hard MoE (its one-hot gate is 1). V-MoE and Experts Choice drop tokens past a buffer capacity and
do not renormalise, so they start near the dense function, not at it; Soft MoE mixes tokens into slots before its
experts, so its upcycled experts start from the dense MLP's weights but compute another function.

WideNet is not upcycled: its blocks share ONE attention and ONE MoE layer, where a dense ViT has one per block.

Transfer to other classes: a dense run trained on other classes (an imported ImageNet-1k model, say) gives everything
but its classifier. The classifier (`head.fc`, in every head that copies it) then starts fresh for the data's classes;
the head's LayerNorm is a feature of the trunk and is copied.
"""

from __future__ import annotations

import os
import re
from typing import Any

from torch import Tensor, nn

from mobile_moe.errors import UsageError
from mobile_moe.models.checkpoint import load_weights
from mobile_moe.models.config import ViTConfig
from mobile_moe.models.moe import STACKED, is_stacked, stacked
from mobile_moe.models.registry import config_from_dict

# The fields the dense run and the MoE must share: the dense weights must fit every place they are copied to.
# The number of classes need not be shared: a dense run of other classes gives all but its classifier (`new_classes`).
SHARED_FIELDS = ("depth", "width", "num_heads", "mlp_ratio", "patch_size", "image_size", "in_chans", "pool", "norm_eps")
CLASSIFIER = "head.fc."  # the dense entries that hold the classes: a transfer to other classes leaves them out
EXPERT_MLP = re.compile(r"mlp\.(?:experts\.)?(?P<entry>fc[12]_(?:weight|bias))")  # the experts' stack, in an MoE block


def check_upcyclable(model: ViTConfig | type[ViTConfig]) -> None:
    """One UsageError line if a dense run cannot initialise this kind of model (its config's upcycle_refusal)."""
    if model.upcycle_refusal is not None:
        raise UsageError(f"--init-from starts a model from a dense vit run: {model.upcycle_refusal}")


def check_dense_fits(moe_config: ViTConfig, dense_config: dict[str, Any], where: str) -> None:
    """One UsageError line unless `dense_config` (a run's config.json "model") is a plain dense vit of the MoE's
    size. `where` names the run (e.g. "--init-from runs/vit")."""
    check_upcyclable(moe_config)
    if dense_config.get("name") != "vit":
        raise UsageError(f"{where} is a {dense_config.get('name')} run; --init-from takes a dense vit run")
    # Through the registry: the dense config is validated as every model config is.
    try:
        theirs = config_from_dict(dense_config).to_dict()
    except UsageError as error:
        raise UsageError(f"{where}: its model config is not valid ({error})") from None
    mine = moe_config.to_dict()
    if theirs["wide_mlp_layers"] or mine.get("wide_mlp_layers"):
        whose = where if theirs["wide_mlp_layers"] else f"--model {moe_config.name} with wide_mlp_layers"
        raise UsageError(f"{whose} widens its last MLPs (a FLOPs-matched baseline); --init-from copies a plain vit's "
                         "MLPs: start from a vit without wide_mlp_layers")  # fmt: skip
    differ = [f"{k} {mine[k]} vs the dense run's {theirs[k]}" for k in SHARED_FIELDS if mine[k] != theirs[k]]
    if differ:
        raise UsageError(
            f"{where}: the dense run does not fit this {moe_config.name} ({'; '.join(differ)}); leave --size, --patch, "
            "--image-size, --num-classes and --pool out (they default to the dense run's) or give its values"
        )


def dense_defaults(dense_config: dict[str, Any], preset: set[str]) -> dict[str, Any]:
    """The dense run's shared fields, as defaults for the MoE's config (explicit flags and the fields a --size preset
    sets win)."""
    return {key: dense_config[key] for key in SHARED_FIELDS if key in dense_config and key not in preset}


def upcycle(
    model: nn.Module, dense_state: dict[str, Tensor], source: str | os.PathLike, *, new_classes: bool = False
) -> list[str]:
    """Copy a dense vit's state dict into `model` by its `dense_key` map; -> the entries that kept their own (fresh)
    values. `new_classes`: the dense run classifies other classes, so its classifier is left out and `model`'s stays
    fresh. A dense state that lacks a needed entry, or whose shapes do not fit, is one UsageError naming `source`."""
    own = model.state_dict()
    mapped, fresh = {}, []
    for key, value in own.items():
        dense = model.dense_key(key)
        if dense is None or (new_classes and dense.startswith(CLASSIFIER)):
            mapped[key] = value
            fresh.append(key)
        elif dense in dense_state:
            mapped[key] = _as_entry(key, value, dense_state[dense])
        else:
            raise UsageError(f"{source}: a dense vit's {dense} is missing (needed for {key}); is it a vit checkpoint?")
    unused = sorted(set(dense_state) - {model.dense_key(key) for key in own})
    unused = [key for key in unused if not (new_classes and key.startswith(CLASSIFIER))]
    if unused:
        raise UsageError(f"{source}: {unused[0]} ({len(unused)} such) has no place in {model.config.name}; is it a "
                         "plain vit checkpoint of the same size?")  # fmt: skip
    load_weights(model, mapped, source)
    return fresh


def _as_entry(key: str, own: Tensor, dense: Tensor) -> Tensor:
    """The dense tensor as the value of the model's entry `key`: a stacked entry (moe.StackedModules) holds it once
    per expert."""
    if is_stacked(key) and isinstance(dense, Tensor) and dense.dim() == own.dim() - 1:
        return stacked([dense] * own.shape[0])
    return dense  # a tensor that does not fit is reported by load_weights


def block_entry(rest: str, dense_block: int) -> str:
    """An MoE block's entry (relative to the block) -> the dense block's: the experts' stacked MLP entries
    (mlp.fc1_weight, or mlp.experts.fc1_weight in a token-routed block) come from mlp.fc1.weight, once per expert;
    attention and norms keep their names."""
    match = EXPERT_MLP.fullmatch(rest)
    return f"blocks.{dense_block}.mlp.{STACKED[match['entry']]}" if match else f"blocks.{dense_block}.{rest}"
