"""Dense ViTs from other libraries: a local timm or torchvision checkpoint -> our ViTConfig and state dict, computing
the same function (checked on a seeded batch before anything is written).

    imported = import_vit(parse_source("timm:deit_tiny_patch16_224"), read_state_dict("deit_tiny.safetensors"))
    imported.config, imported.state_dict, imported.preprocessing, imported.max_abs_difference

Each library has its own module (timm_vit.py, torchvision_vit.py): it builds the library's own model for the name
(never pretrained: nothing is downloaded) at the checkpoint's class count and image size, loads the checkpoint into
it, refuses what our ViT cannot express (one line naming the first mismatch) and maps the rest, key by key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mobile_moe.errors import UsageError
from mobile_moe.models.checkpoint import WEIGHT_DTYPES, first_reason, not_finite, torch_load, weight_kind_problem
from mobile_moe.models.config import ViTConfig

LIBRARIES = ("timm", "torchvision")
PARITY_TOLERANCE = 1e-5  # max abs logit difference (float32) an import must meet
WRAPPERS = ("state_dict", "model", "module", "model_state_dict")  # where training scripts nest the weights
WEIGHTS_HELP = {
    "timm": "timm keeps downloaded weights in the Hugging Face cache (~/.cache/huggingface/hub/models--timm--{name}"
    ".<tag>/snapshots/*/model.safetensors); on a connected machine run "
    '`python -c "import timm, torch; torch.save(timm.create_model('
    "'{name}', pretrained=True).state_dict(), '{name}.pth')\"` and copy the file here",
    "torchvision": "torchvision keeps downloaded weights in ~/.cache/torch/hub/checkpoints/; on a connected machine "
    "run `python -c \"import torch, torchvision; torch.save(torchvision.models.get_model('{name}', weights='DEFAULT')"
    ".state_dict(), '{name}.pth')\"` and copy the file here",
}


@dataclass(frozen=True)
class Source:
    library: str  # "timm" | "torchvision"
    name: str  # the library's model name, e.g. deit_tiny_patch16_224, vit_b_32

    def __str__(self) -> str:
        return f"{self.library}:{self.name}"


@dataclass
class Preprocessing:
    """How the source library evaluates the model: what our run's data record and eval resize policy carry on."""

    mean: list[float]
    std: list[float]
    eval_resize: dict[str, Any]  # a mobile_moe.preprocess policy record


@dataclass
class ImportedViT:
    source: Source
    config: ViTConfig
    state_dict: dict[str, Tensor]
    preprocessing: Preprocessing
    class_names: list[str] | None  # the library's names for a head of its pretraining classes (ImageNet-1k)
    max_abs_difference: float  # our logits vs the source model's on a seeded batch


def parse_source(text: str) -> Source:
    library, sep, name = text.partition(":")
    if not sep or library not in LIBRARIES or not name:
        raise UsageError(
            f"model {text!r}: use timm:NAME (e.g. timm:deit_tiny_patch16_224) or torchvision:NAME (e.g. "
            "torchvision:vit_b_32)"
        )
    return Source(library, name)


def read_state_dict(path: str | os.PathLike, source: Source) -> dict[str, Tensor]:
    """The tensors of a checkpoint file (.safetensors, or torch.save'd and loaded with weights_only=True): a plain
    state dict, or one nested under state_dict/model/... as training scripts save it; a DDP "module." prefix is
    dropped. A missing file says where the library keeps its weights; an unreadable one is one line."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise UsageError(f"--weights {path}: not a regular file; give the checkpoint file")
    if not path.is_file():
        where = WEIGHTS_HELP[source.library].format(name=source.name)
        raise UsageError(f"--weights {path}: no such file (nothing is downloaded here); {where}")
    try:
        if path.suffix.lower() == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
        else:
            state = torch_load(path, map_location="cpu")
    except Exception as error:  # each format raises its own types for a damaged or foreign file
        raise UsageError(
            f"--weights {path}: cannot read it as a checkpoint ({first_reason(error)}); it is loaded with "
            "weights_only=True: save the model's state_dict() alone (torch.save or safetensors) and import that"
        ) from None
    state = _unwrap(state)
    if state is None:
        raise UsageError(
            f"--weights {path}: holds no state dict (expected name -> tensor, possibly under one of "
            f"{', '.join(WRAPPERS)})"
        )
    problem = next((f"{key!r}: {why}" for key, value in state.items() if (why := _not_a_weight(key, value))), None)
    if problem is not None:
        raise UsageError(f"--weights {path}: entry {problem}; import takes a model's state_dict() of dense tensors")
    unwrapped = {key.removeprefix("module."): value for key, value in state.items()}
    if len(unwrapped) != len(state):
        raise UsageError(f"--weights {path}: holds both NAME and module.NAME entries; save one model's state_dict()")
    return unwrapped


def _not_a_weight(key: Any, value: Tensor) -> str | None:
    """Why a state-dict entry is not one we take (None: it is): a weight as a run's checkpoint holds one
    (checkpoint.weight_kind_problem, the one rule), or a scalar counter (BatchNorm's), with values, all finite."""
    if not isinstance(key, str):
        return "its name is not a string"
    counter = value.dtype in (torch.int32, torch.int64) and value.layout == torch.strided and value.dim() == 0
    if counter and value.device.type == "cpu":
        return None  # a 0-d integer on the CPU is a counter (BatchNorm's), no weight
    why = weight_kind_problem(value)
    if why is not None:
        dtypes = " or ".join(str(dtype).removeprefix("torch.") for dtype in WEIGHT_DTYPES)
        return f"{why} (weights are dense {dtypes})"
    if not_finite(value):
        return "holds values that are not finite"
    return None


def _unwrap(state: Any, depth: int = 3) -> dict[str, Tensor] | None:
    """The name -> tensor dict in a checkpoint: `state` itself, or one nested under WRAPPERS (at most `depth` deep)."""
    if isinstance(state, dict) and state and all(isinstance(v, Tensor) for v in state.values()):
        return state
    if isinstance(state, dict) and depth > 0:
        for key in WRAPPERS:
            if key in state:
                return _unwrap(state[key], depth - 1)
    return None


def import_vit(source: Source, state: dict[str, Tensor]) -> ImportedViT:
    """Map `state` (a checkpoint of `source`) onto our dense ViT; refuses a mismatch or a parity failure."""
    return convert_model(source, _library(source).build(source, state))


def convert_model(source: Source, theirs: nn.Module) -> ImportedViT:
    """The library's own model `theirs` (weights loaded) as our dense ViT, its logits checked against `theirs`."""
    library = _library(source)
    library.check_architecture(source, theirs)
    config, mapped = library.convert(source, theirs.eval())
    ours = _load_ours(source, config, mapped)
    difference = max_abs_difference(ours, theirs, library.classifier(theirs), config)
    if not difference <= PARITY_TOLERANCE:
        raise UsageError(
            f"{source}: the imported model's logits differ from the source's by {difference:.3g} (more than "
            f"{PARITY_TOLERANCE:g}); this model uses something the mapping does not cover: please report it"
        )
    preprocessing = library.preprocessing(source, theirs, config)
    return ImportedViT(source, config, ours.state_dict(), preprocessing, imagenet_classes(config), difference)


def _library(source: Source):
    if source.library == "timm":
        from mobile_moe.importers import timm_vit

        return timm_vit
    from mobile_moe.importers import torchvision_vit

    return torchvision_vit


def imagenet_classes(config: ViTConfig) -> list[str] | None:
    """A 1000-way head is taken to be ImageNet-1k's, in the standard order: its WordNet ids (n01440764, ...), which are
    also the class folder names of ImageNet's train and val layouts (sorted, so ImageFolder's order). From timm's
    bundled ImageNet info: nothing is downloaded. Other heads: None (the caller asks for names)."""
    if config.num_classes != 1000:
        return None
    from timm.data import ImageNetInfo

    return list(ImageNetInfo().label_names())


def load_into_source(source: Source, model: nn.Module, state: dict[str, Tensor]) -> nn.Module:
    """`state` into the library's own model, every key and shape checked; what does not fit is the one line."""
    from mobile_moe.models.checkpoint import state_mismatches

    problems = state_mismatches(model.state_dict(), state)
    if problems:
        raise UsageError(
            f"--weights does not fit {source}: {'; '.join(problems)} among {source.name}'s entries; was it saved "
            "from another model or size?"
        )
    try:
        model.load_state_dict(state)
    except (RuntimeError, ValueError, TypeError) as error:
        raise UsageError(f"--weights does not load into {source}: {first_reason(error)}") from None
    return model.eval()


def _load_ours(source: Source, config: ViTConfig, state: dict[str, Tensor]) -> nn.Module:
    from mobile_moe.models.checkpoint import load_weights
    from mobile_moe.models.vit import VisionTransformer

    model = VisionTransformer(config)
    load_weights(model, state, str(source))
    return model.eval()


@torch.no_grad()
def max_abs_difference(ours: nn.Module, theirs: nn.Module, their_head: nn.Linear, config: ViTConfig) -> float:
    """max |ours - the source's| over the logits AND the classifier's input features, on a seeded standard-normal
    batch (float32). The features count too because a head initialised to zero (torchvision's) makes every logit 0
    whatever the blocks compute."""
    shape = (2, config.in_chans, config.image_size, config.image_size)
    images = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    features = []
    hooks = [head.register_forward_hook(lambda _m, args, _o: features.append(args[0])) for head in (ours.head.fc,
             their_head)]  # fmt: skip
    try:
        logits = (ours(images).logits - theirs(images)).abs().max()
    finally:
        for hook in hooks:
            hook.remove()
    return float(max(logits, (features[0] - features[1]).abs().max()))


def refuse(source: Source, what: str) -> UsageError:
    """The one line for a model our ViT cannot express: what differs, and what import takes."""
    return UsageError(
        f"{source}: {what}; import takes plain ViTs (patch embedding, class token or mean pooling, pre-norm blocks "
        "of attention and a GELU MLP, a linear head)"
    )


def mlp_ratio_of(source: Source, width: int, hidden: int) -> float:
    ratio = hidden / width
    if int(width * ratio) != hidden:
        raise refuse(source, f"our config cannot express MLP hidden size {hidden} at width {width}")
    return ratio
