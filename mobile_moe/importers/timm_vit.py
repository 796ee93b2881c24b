"""timm's VisionTransformer (vit_*, deit_* without distillation, ...) -> our dense ViT.

Maps: patch_embed.proj, cls_token, pos_embed (a zero row for the class token when timm keeps it out of the position
embedding, no_embed_class), every block's norm1 / attn.qkv / attn.proj / norm2 / mlp.fc1 / mlp.fc2, the final norm and
the head; a qkv without bias becomes a zero bias. Everything else must be absent (an Identity in timm): layer scale,
q/k norms, register tokens, a pre-norm, an fc_norm, attention pooling; the first one present is refused by name.
DeiT's distilled models are refused: their distillation token takes part in every attention and their logits average
two heads, which our ViT does not have, so no mapping can keep their function.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from mobile_moe.errors import UsageError
from mobile_moe.importers import Preprocessing, Source, load_into_source, mlp_ratio_of, refuse
from mobile_moe.models.config import ViTConfig
from mobile_moe.preprocess import resize_center_crop

POOLS = {(True, "token"): "cls", (False, "avg"): "mean"}  # (has a class token, timm's global_pool) -> our pool


def build(source: Source, state: dict[str, Tensor]) -> nn.Module:
    """timm's own model for `source` at the checkpoint's class count and image size, with the checkpoint loaded."""
    import timm

    if not timm.is_model(source.name):
        raise UsageError(f"{source}: timm has no model of that name (`timm.list_models('*vit*')` lists the ViTs)")
    head = state.get("head.weight")
    has_head = head is not None and head.dim() == 2 and head.shape[0] > 0
    model = _create(source, **({"num_classes": head.shape[0]} if has_head else {}))
    check_architecture(source, model)  # the architecture first: a ResNet's state dict has no head.weight either
    if not has_head:
        raise UsageError(
            f"--weights has no 2-d head.weight, so it is not a timm ViT classifier's state dict (its first entries: "
            f"{', '.join(list(state)[:3])})"
        )
    size = _image_size(model, state.get("pos_embed"))
    if size not in (None, model.patch_embed.img_size[0]):
        model = _create(source, num_classes=model.num_classes, img_size=size)
    return load_into_source(source, model, state)


def _create(source: Source, **kwargs) -> nn.Module:
    import timm

    try:
        return timm.create_model(source.name, pretrained=False, **kwargs)
    except Exception as error:  # timm raises what its model constructors raise
        raise UsageError(f"{source}: timm cannot build it at {kwargs} ({error.__class__.__name__}: {error})") from None


def _image_size(model: nn.Module, pos_embed: Tensor | None) -> int | None:
    """The image side the checkpoint's position embedding was trained for (None: not a square grid we read)."""
    if pos_embed is None or pos_embed.dim() != 3:
        return None
    patches = pos_embed.shape[1] - (0 if model.no_embed_class else model.num_prefix_tokens)
    grid = math.isqrt(max(patches, 0))
    return grid * model.patch_embed.proj.kernel_size[0] if grid * grid == patches and grid else None


def _identity(module: nn.Module | None) -> bool:
    return module is None or isinstance(module, nn.Identity)


def check_architecture(source: Source, model: nn.Module) -> None:
    """The first part of `model` our ViT cannot express, as one refusal."""
    from timm.layers import Mlp, PatchEmbed
    from timm.models.vision_transformer import Attention, Block, VisionTransformer

    if hasattr(model, "dist_token"):
        raise refuse(source, "it has a distillation token (DeiT distilled), which attends in every block and has its "
                     "own head; import the non-distilled deit_* model instead")  # fmt: skip
    if type(model) is not VisionTransformer:
        raise refuse(source, f"it is a timm {type(model).__name__}, not timm's VisionTransformer")
    if type(model.patch_embed) is not PatchEmbed:
        raise refuse(source, f"its patch embedding is a {type(model.patch_embed).__name__} (a hybrid ViT)")
    pool = (model.has_class_token, model.global_pool)
    checks = [
        (model.num_classes > 0, "it has no classifier head (num_classes 0)"),
        (getattr(model, "num_reg_tokens", 0) == 0, f"it has {model.num_reg_tokens} register tokens"),
        (model.attn_pool is None, "it pools with attention (global_pool 'map')"),
        (pool in POOLS, f"global_pool {model.global_pool!r} with{'' if pool[0] else 'out'} a class token"),
        (_identity(model.norm_pre), "it normalises the tokens before the blocks (pre_norm)"),
        (_identity(model.fc_norm), "it normalises after pooling (fc_norm)"),
        (isinstance(model.norm, nn.LayerNorm), f"its final norm is a {type(model.norm).__name__}"),
        (isinstance(model.head, nn.Linear), f"its head is a {type(model.head).__name__}"),
        (_identity(model.patch_embed.norm), "its patch embedding has a norm"),
        (_plain_patch_conv(model.patch_embed.proj), "its patch embedding is not one patch-sized, patch-strided conv"),
    ]
    for i, block in enumerate(model.blocks):
        where = f"block {i}"
        checks += [
            (type(block) is Block, f"{where} is a {type(block).__name__}, not timm's pre-norm Block"),
            (type(getattr(block, "attn", None)) is Attention, f"{where}'s attention is not timm's Attention"),
            (type(getattr(block, "mlp", None)) is Mlp, f"{where}'s MLP is not timm's Mlp (e.g. SwiGLU)"),
        ]
        if not all(ok for ok, _ in checks):
            break
        attn, mlp = block.attn, block.mlp
        checks += [
            (_identity(block.ls1) and _identity(block.ls2), f"{where} has layer scale"),
            (_identity(attn.q_norm) and _identity(attn.k_norm), f"{where} normalises queries and keys"),
            (_identity(attn.norm) and getattr(attn, "gate", None) is None, f"{where}'s attention has a norm or gate"),
            (_identity(mlp.norm), f"{where}'s MLP has a norm"),
            (type(mlp.act) is nn.GELU and mlp.act.approximate == "none", f"{where}'s MLP activation is {mlp.act}"),
            (
                _same_norm(model, block.norm1) and _same_norm(model, block.norm2),
                f"{where}'s norms differ from the final norm (type or epsilon)",
            ),  # fmt: skip
        ]
    failed = next((what for ok, what in checks if not ok), None)
    if failed is not None:
        raise refuse(source, failed)


def _plain_patch_conv(conv: nn.Module) -> bool:
    return (
        isinstance(conv, nn.Conv2d)
        and conv.kernel_size == conv.stride
        and conv.kernel_size[0] == conv.kernel_size[1]
        and conv.padding == (0, 0)
        and conv.groups == 1
        and conv.dilation == (1, 1)
    )


def _same_norm(model: nn.Module, norm: nn.Module) -> bool:
    return isinstance(norm, nn.LayerNorm) and norm.eps == model.norm.eps and norm.weight is not None


def convert(source: Source, model: nn.Module) -> tuple[ViTConfig, dict[str, Tensor]]:
    """Our ViTConfig for `model` (checked by check_architecture) and its weights under our names."""
    first = model.blocks[0]
    width, hidden = model.embed_dim, first.mlp.fc1.out_features
    heads = first.attn.num_heads
    if any(block.attn.num_heads != heads or block.mlp.fc1.out_features != hidden for block in model.blocks):
        raise refuse(source, "its blocks differ in heads or MLP size")
    config = ViTConfig(
        image_size=model.patch_embed.img_size[0],
        patch_size=model.patch_embed.proj.kernel_size[0],
        in_chans=model.patch_embed.proj.in_channels,
        num_classes=model.num_classes,
        depth=len(model.blocks),
        width=width,
        num_heads=heads,
        mlp_ratio=mlp_ratio_of(source, width, hidden),
        pool=POOLS[(model.has_class_token, model.global_pool)],
        norm_eps=float(model.norm.eps),
    )
    state = {**_linear("embedding.patch_embed.proj", model.patch_embed.proj)}
    if model.has_class_token:
        state["embedding.cls_token"] = model.cls_token
    state["embedding.pos_embed"] = _position_embedding(model, config)
    for i, block in enumerate(model.blocks):
        for ours, theirs in (
            ("norm1", block.norm1),
            ("attn.qkv", block.attn.qkv),
            ("attn.proj", block.attn.proj),
            ("norm2", block.norm2),
            ("mlp.fc1", block.mlp.fc1),
            ("mlp.fc2", block.mlp.fc2),
        ):
            state.update(_linear(f"blocks.{i}.{ours}", theirs))
    state.update(_linear("head.norm", model.norm))
    state.update(_linear("head.fc", model.head))
    return config, {key: value.detach().clone() for key, value in state.items()}


def _linear(prefix: str, module: nn.Module) -> dict[str, Tensor]:
    """weight and bias of a Linear, Conv2d or LayerNorm; a missing bias is a zero one (the same function)."""
    bias = module.bias if module.bias is not None else torch.zeros(module.weight.shape[0])
    return {f"{prefix}.weight": module.weight, f"{prefix}.bias": bias}


def _position_embedding(model: nn.Module, config: ViTConfig) -> Tensor:
    """(1, T, D) over every token ours adds it to: timm may leave the class token out (no_embed_class) or have none
    at all (pos_embed 'none'), and a zero row or zero table is the same function."""
    pos = model.pos_embed
    if pos is None:
        return torch.zeros(1, config.num_tokens, config.width)
    if model.no_embed_class and model.has_class_token:
        return torch.cat([torch.zeros(1, 1, config.width), pos], dim=1)
    return pos


def classifier(model: nn.Module) -> nn.Linear:
    return model.head


def preprocessing(source: Source, model: nn.Module, config: ViTConfig) -> Preprocessing:
    """timm's data config for the model (resolve_model_data_config: its pretrained config, else timm's defaults):
    mean/std, and its eval transform (shorter side to floor(S / crop_pct), centre crop) with its interpolation."""
    from timm.data import resolve_model_data_config

    cfg = resolve_model_data_config(model)
    mode, interpolation = cfg["crop_mode"], cfg["interpolation"]
    if mode != "center" or interpolation not in ("bilinear", "bicubic"):
        raise UsageError(
            f"{source}: timm evaluates it with crop_mode {mode!r} and {interpolation} interpolation; our eval resize "
            "policies are a bilinear or bicubic center crop or stretch (mobile_moe/preprocess.py)"
        )
    resize_to = math.floor(config.image_size / cfg["crop_pct"])
    return Preprocessing(
        mean=[float(v) for v in cfg["mean"]],
        std=[float(v) for v in cfg["std"]],
        eval_resize=resize_center_crop(config.image_size, max(resize_to, config.image_size), interpolation),
    )
