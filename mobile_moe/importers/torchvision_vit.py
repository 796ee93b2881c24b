"""torchvision's VisionTransformer (vit_b_16, vit_b_32, vit_l_16, vit_l_32, vit_h_14) -> our dense ViT.

Maps: conv_proj, class_token, encoder.pos_embedding, every encoder layer's ln_1 / self_attention (in_proj -> qkv: the
same [q; k; v] rows, heads in contiguous slices) / out_proj / ln_2 / mlp.0 / mlp.3, encoder.ln and heads.head.
Refused: a conv stem (conv_stem_configs) and a pre-logits layer (representation_size).
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from mobile_moe.errors import UsageError
from mobile_moe.importers import Preprocessing, Source, load_into_source, mlp_ratio_of, refuse
from mobile_moe.models.config import ViTConfig
from mobile_moe.preprocess import resize_center_crop


def build(source: Source, state: dict[str, Tensor]) -> nn.Module:
    """torchvision's own model for `source` at the checkpoint's class count and image size, checkpoint loaded."""
    import torchvision

    vits = sorted(name for name in torchvision.models.list_models(module=torchvision.models) if name.startswith("vit_"))
    if source.name not in vits:
        raise UsageError(f"{source}: not one of torchvision's ViTs ({', '.join(vits)})")
    head = state.get("heads.head.weight")
    if head is None or head.dim() != 2 or head.shape[0] < 1:
        raise UsageError(
            f"--weights has no 2-d heads.head.weight, so it is not a torchvision ViT classifier's state dict (its "
            f"first entries: {', '.join(list(state)[:3])})"
        )
    kwargs = {"num_classes": head.shape[0]}
    model = _create(source, **kwargs)
    check_architecture(source, model)
    pos = state.get("encoder.pos_embedding")
    grid = math.isqrt(pos.shape[1] - 1) if pos is not None and pos.dim() == 3 and pos.shape[1] > 1 else 0
    if grid and grid * grid == pos.shape[1] - 1 and grid * model.patch_size != model.image_size:
        model = _create(source, **kwargs, image_size=grid * model.patch_size)
    return load_into_source(source, model, state)


def _create(source: Source, **kwargs) -> nn.Module:
    import torchvision

    try:
        return torchvision.models.get_model(source.name, weights=None, **kwargs)
    except Exception as error:  # the builders raise what VisionTransformer raises
        raise UsageError(
            f"{source}: torchvision cannot build it at {kwargs} ({error.__class__.__name__}: {error})"
        ) from None


def check_architecture(source: Source, model: nn.Module) -> None:
    from torchvision.models.vision_transformer import EncoderBlock, VisionTransformer

    checks = [
        (type(model) is VisionTransformer, f"it is a {type(model).__name__}"),
        (isinstance(model.conv_proj, nn.Conv2d), "it has a convolutional stem (conv_stem_configs)"),
        (list(dict(model.heads.named_children())) == ["head"], "it has a pre-logits layer (representation_size)"),
    ]
    for i, layer in enumerate(model.encoder.layers):
        attention = getattr(layer, "self_attention", None)
        checks += [
            (type(layer) is EncoderBlock, f"encoder layer {i} is a {type(layer).__name__}"),
            (
                isinstance(attention, nn.MultiheadAttention)
                and attention._qkv_same_embed_dim
                and attention.in_proj_bias is not None
                and attention.bias_k is None
                and not attention.add_zero_attn,
                f"encoder layer {i}'s attention is not a plain biased multi-head attention",
            ),
        ]
    failed = next((what for ok, what in checks if not ok), None)
    if failed is not None:
        raise refuse(source, failed)


def convert(source: Source, model: nn.Module) -> tuple[ViTConfig, dict[str, Tensor]]:
    layers = list(model.encoder.layers)
    width, hidden = model.hidden_dim, model.mlp_dim
    config = ViTConfig(
        image_size=model.image_size,
        patch_size=model.patch_size,
        in_chans=model.conv_proj.in_channels,
        num_classes=model.num_classes,
        depth=len(layers),
        width=width,
        num_heads=layers[0].num_heads,
        mlp_ratio=mlp_ratio_of(source, width, hidden),
        pool="cls",
        norm_eps=float(model.encoder.ln.eps),
    )
    if any(layer.ln_1.eps != config.norm_eps or layer.ln_2.eps != config.norm_eps for layer in layers):
        raise refuse(source, "its LayerNorms differ in epsilon")
    state = {
        **_params("embedding.patch_embed.proj", model.conv_proj),
        "embedding.cls_token": model.class_token,
        "embedding.pos_embed": model.encoder.pos_embedding,
        **_params("head.norm", model.encoder.ln),
        **_params("head.fc", model.heads.head),
    }
    for i, layer in enumerate(layers):
        attention = layer.self_attention
        state[f"blocks.{i}.attn.qkv.weight"] = attention.in_proj_weight
        state[f"blocks.{i}.attn.qkv.bias"] = attention.in_proj_bias
        for ours, theirs in (
            ("norm1", layer.ln_1),
            ("attn.proj", attention.out_proj),
            ("norm2", layer.ln_2),
            ("mlp.fc1", layer.mlp[0]),
            ("mlp.fc2", layer.mlp[3]),
        ):
            state.update(_params(f"blocks.{i}.{ours}", theirs))
    return config, {key: value.detach().clone() for key, value in state.items()}


def _params(prefix: str, module: nn.Module) -> dict[str, Tensor]:
    return {f"{prefix}.weight": module.weight, f"{prefix}.bias": module.bias}


def classifier(model: nn.Module) -> nn.Linear:
    return model.heads.head


def preprocessing(source: Source, model: nn.Module, config: ViTConfig) -> Preprocessing:
    """The eval transform of the model's published weights (torchvision's ImageClassification: shorter side to
    resize_size, centre crop): the entry for this image size, else the first one's resize ratio at this size."""
    import torchvision

    entries = [weights.transforms() for weights in torchvision.models.get_model_weights(source.name)]
    chosen = next((t for t in entries if t.crop_size[0] == config.image_size), entries[0])
    resize_to = round(config.image_size * chosen.resize_size[0] / chosen.crop_size[0])
    interpolation = chosen.interpolation.value
    if interpolation not in ("bilinear", "bicubic"):
        raise UsageError(
            f"{source}: torchvision evaluates it with {interpolation} interpolation; our eval resize policies are "
            "bilinear or bicubic (mobile_moe/preprocess.py)"
        )
    return Preprocessing(
        mean=[float(v) for v in chosen.mean],
        std=[float(v) for v in chosen.std],
        eval_resize=resize_center_crop(config.image_size, resize_to, interpolation),
    )
