"""Model flags shared by every command that builds a model (info, train): the documented spellings.

Options without a flag of their own (capacity ratios, router noise, Soft MoE slots, ...) go through
`--model-kwargs KEY=VALUE ...`, timm's spelling, type-checked against the model's config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import typing

from mobile_moe.errors import UsageError
from mobile_moe.models.config import PRESETS, ViTConfig
from mobile_moe.models.registry import MODELS, make_config

# flag dest -> its spelling (the config field has the dest's name)
MODEL_FLAGS = {
    "patch_size": "--patch",
    "image_size": "--image-size",
    "num_classes": "--num-classes",
    "pool": "--pool",
    "num_experts": "--experts",
    "top_k": "--top-k",
    "moe_layers": "--moe-layers",
}


def add_model_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", required=required, choices=sorted(MODELS), help="registered model name")
    group.add_argument("--size", help=f"DEPTHxWIDTH (e.g. 12x192: the paper's grid and heads; another width gets "
                       f"heads of 64, 32, 16 or 8 channels) or {' / '.join(PRESETS)} (default "
                       f"{ViTConfig.depth}x{ViTConfig.width}: ViT-Ti)")  # fmt: skip
    group.add_argument("--patch", type=int, dest="patch_size", help="patch size (default 32)")
    group.add_argument("--image-size", type=int, help="input resolution (default 224)")
    group.add_argument("--num-classes", type=int, help="classes (default 1000)")
    group.add_argument("--pool", choices=["cls", "mean"], help="class-token (default) or mean pooling")
    group.add_argument("--experts", type=int, dest="num_experts", help="E, experts per MoE block (default 10)")
    group.add_argument("--top-k", type=int, help="k, experts per image (per token for per-token routers)")
    group.add_argument("--moe-layers", type=int, help="L, MoE blocks (default 2)")
    group.add_argument(
        "--model-kwargs",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="other model options, e.g. capacity_ratio=1.05 moe_placement=every-other (see `info --json` config)",
    )


def _field_value(cls: type[ViTConfig], key: str, text: str) -> object:
    """`text` as the type of config field `key` of `cls`: JSON numbers, true/false, null, or a plain string."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if key not in fields or key in MODEL_FLAGS or key in ("depth", "width", "num_heads"):
        options = sorted(set(fields) - set(MODEL_FLAGS) - {"depth", "width", "num_heads"})
        hint = f" (use {MODEL_FLAGS[key]})" if key in MODEL_FLAGS else ""
        hint = " (use --size)" if key in ("depth", "width", "num_heads") else hint
        raise UsageError(f"--model-kwargs {key}: not an option of {cls.name}{hint}; its options: {', '.join(options)}")
    hints = typing.get_type_hints(cls)
    kind = hints[key]
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"--model-kwargs {key}={text}: must be a finite number")
    allowed = typing.get_args(kind) or (kind,)
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not any((value is None and t is type(None)) or (t is not type(None) and type(value) is t) for t in allowed):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
        raise UsageError(f"--model-kwargs {key}={text}: expected {names}")
    return value


def model_kwargs(args: argparse.Namespace, model: str | None = None) -> dict[str, object]:
    """--model-kwargs KEY=VALUE ... -> {field: typed value} for `model` (default: args.model)."""
    name = model or args.model
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    cls = MODELS[name]
    found: dict[str, object] = {}
    for item in getattr(args, "model_kwargs", None) or []:
        key, sep, text = item.partition("=")
        if not sep:
            raise UsageError(f"--model-kwargs {item!r}: use KEY=VALUE (e.g. capacity_ratio=1.05)")
        found[key.strip()] = _field_value(cls, key.strip(), text)
    return found


def config_from_args(args: argparse.Namespace, **defaults: object) -> ViTConfig:
    """Build the config; a flag the model has no option for is an error rather than silently ignored."""
    cls = MODELS[args.model]
    known = {f.name for f in dataclasses.fields(cls)}
    fields = {name: getattr(args, name) for name in MODEL_FLAGS if getattr(args, name, None) is not None}
    misplaced = [MODEL_FLAGS[name] for name in fields if name not in known]
    if misplaced:
        hint = "drop them or use --model mobile-vmoe" if cls.routing == "none" else "drop them"
        raise UsageError(f"{', '.join(misplaced)}: model {args.model} has no such option; {hint}")
    try:
        return make_config(args.model, args.size, **{**defaults, **fields, **model_kwargs(args)})
    except UsageError as error:
        raise UsageError(_naming_the_default(str(error), given=fields)) from None


def _naming_the_default(refusal: str, *, given: dict[str, object]) -> str:
    """A config's refusal of a field ("moe_layers=2: ...") that has a flag the command line left out: the value is the
    flag's default, which the line then says, so the user knows which flag to give."""
    field, _, rest = refusal.partition(":")[0].partition("=")
    if field not in MODEL_FLAGS or field in given or not rest:
        return refusal
    return f"{refusal}; {rest.split()[0]} is the default of {MODEL_FLAGS[field]}: give {MODEL_FLAGS[field]}"
