"""Training recipes: Python functions returning a `TrainConfig`, each docstring giving its launch command
(big_vision's `get_config()` style). The CLI overrides single fields, type-checked (`--set key=value`).

The model (size, E, k, L) is not part of a recipe: it comes from the model flags.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from mobile_moe.data.augment import INPUT_PIPELINES, MAGNITUDE_BINS, Augmentation
from mobile_moe.errors import UsageError
from mobile_moe.utils.devices import DEVICES
from mobile_moe.utils.words import counted

ROUTE_BY = ("router", "label")
# What a resumed run may change: how it runs, and how long (epochs: not fewer than already done). Anything else
# would make it a different run.
MAY_CHANGE_ON_RESUME = ("epochs", "device", "workers", "compile", "cuda_graphs", "eval_batch_size")


# The largest value each TrainConfig field takes: a seed within numpy's and torch's seeds whatever epoch and rank add;
# batches DataLoader's sampler can slice (sys.maxsize) far beyond any memory; a schedule and an augmentation that end.
UPPER_BOUNDS = {"seed": 2**32 - 1, "epochs": 10**6, "warmup_epochs": 10**6, "batch_size": 2**24, "base_batch": 2**24,
                "eval_batch_size": 2**24, "randaugment_ops": 64}  # fmt: skip


@dataclass
class TrainConfig:
    # --- optimisation (AdamW, cosine schedule with linear warm-up, stepped every iteration) ---
    epochs: int = 300
    batch_size: int = 1024  # global batch, split evenly over DDP processes
    base_lr: float = 5e-4  # learning rate for a global batch of `base_batch`; scaled linearly with batch_size
    base_batch: int = 512
    min_lr: float = 1e-5
    warmup_epochs: float = 5.0
    weight_decay: float = 0.05
    grad_clip: float = 0.0  # max gradient norm; 0 disables clipping
    label_smoothing: float = 0.1
    # --- augmentation (torchvision.transforms.v2) ---
    crop_scale: float = 0.08  # RandomResizedCrop scale range (crop_scale, 1); 1 disables the crop
    hflip: bool = True
    randaugment_ops: int = 2  # 0 disables RandAugment
    randaugment_magnitude: int = 9
    mixup_alpha: float = 0.8  # 0 disables MixUp
    cutmix_alpha: float = 1.0  # 0 disables CutMix; with both on, one of the two is picked per batch
    random_erasing: float = 0.25  # probability; 0 disables
    # --- the super-class router loss (paper, Sec. 2.2) ---
    router_loss_weight: float = 0.3  # lambda in L = CE(logits, y) + lambda * CE(router_logits, super(y))
    route_by: str = "router"  # "router": the router's own top-k; "label": the true super-class first (see losses)
    balance_loss_weight: float = 0.0  # Switch-style load-balancing loss, for end-to-end routing (lambda = 0)
    # --- running ---
    seed: int = 0
    workers: int = -1  # DataLoader worker processes per training process; -1: one per usable core (recorded so)
    input_pipeline: str = "auto"  # workers | crop | device (data/inputs.py); a run records the one it resolved to
    eval_batch_size: int = 256
    device: str = "auto"  # auto | cpu | cuda
    amp: bool = True  # bf16 autocast on CUDA (ignored on CPU)
    compile: bool = False  # torch.compile the model
    cuda_graphs: bool = True  # with compile, on CUDA: the step replayed as CUDA graphs (engine.compile_options)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"{f.name}={value}: must be a finite number")
        for name, most in UPPER_BOUNDS.items():  # beyond them a seed overflows torch's, a schedule overflows, ...
            if getattr(self, name) > most:
                raise UsageError(f"{name}={getattr(self, name)}: must be at most {most}")
        for name in ("epochs", "batch_size", "base_batch", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.seed < -UPPER_BOUNDS["seed"]:  # negative seeds trained (and their runs resume), as far from 0
            raise UsageError(f"seed={self.seed}: must be at least {-UPPER_BOUNDS['seed']}")
        for name in ("base_lr", "min_lr", "warmup_epochs", "weight_decay", "grad_clip", "router_loss_weight",
                     "balance_loss_weight", "mixup_alpha", "cutmix_alpha", "randaugment_ops"):  # fmt: skip
            if getattr(self, name) < 0:
                raise UsageError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.workers < -1:
            raise UsageError(f"workers={self.workers}: must be >= 0, or -1 for one per usable core")
        for name in ("label_smoothing", "random_erasing"):
            if not 0 <= getattr(self, name) < 1:
                raise UsageError(f"{name}={getattr(self, name)}: must be in [0, 1)")
        if not 0 <= self.randaugment_magnitude < MAGNITUDE_BINS:
            magnitude = self.randaugment_magnitude
            raise UsageError(f"randaugment_magnitude={magnitude}: must be from 0 to {MAGNITUDE_BINS - 1}")
        if not 0 < self.crop_scale <= 1:
            raise UsageError(f"crop_scale={self.crop_scale}: must be in (0, 1]")
        if self.route_by not in ROUTE_BY:
            raise UsageError(f"route_by={self.route_by!r}: choose one of {', '.join(ROUTE_BY)}")
        if self.input_pipeline not in INPUT_PIPELINES:
            raise UsageError(f"input_pipeline={self.input_pipeline!r}: choose one of {', '.join(INPUT_PIPELINES)}")
        if self.device not in DEVICES:
            raise UsageError(f"device={self.device!r}: choose one of {', '.join(DEVICES)}")

    @property
    def augmentation(self) -> Augmentation:
        """The recipe's augmentation fields, as the data pipelines take them."""
        return Augmentation(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Augmentation)})

    @property
    def lr(self) -> float:
        """Peak learning rate: base_lr x batch_size / base_batch (the DeiT scaling rule)."""
        return self.base_lr * self.batch_size / self.base_batch

    def short_run_warning(self) -> str | None:
        """What to say, before the first step, when the run will end inside its linear warm-up: the learning rate never
        reaches its peak, and the cosine decay never starts (a short fine-tune on the deit recipe, say)."""
        if self.epochs > self.warmup_epochs:
            return None
        warmup = f"{self.warmup_epochs:g} epoch" + ("" if self.warmup_epochs == 1 else "s")
        return (
            f"warning: the run ends after {counted(self.epochs, 'epoch')}, inside the recipe's warm-up of {warmup}, "
            f"so the learning rate never reached its peak; give --epochs more than {self.warmup_epochs:g} "
            f"or --set warmup_epochs={max(self.epochs / 5, 0.1):g}"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with fields changed; unknown fields and wrong types are UsageErrors (values are parsed if strings)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise UsageError(f"unknown training option(s) {', '.join(unknown)}; known: {', '.join(fields)}")
        parsed = {name: _coerce(name, value, type(getattr(self, name))) for name, value in changes.items()}
        return dataclasses.replace(self, **parsed)


def _coerce(name: str, value: Any, kind: type) -> Any:
    """Parse a CLI string (or check a Python value) against the field's type: bool, int, float or str."""
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        if kind is bool:
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise UsageError(f"{name}={value!r}: expected true or false")
        try:
            parsed = kind(value)
        except ValueError:
            raise UsageError(f"{name}={value!r}: expected {kind.__name__}") from None
        if kind is float and not math.isfinite(parsed):
            raise UsageError(f"{name}={value!r}: expected a finite number")
        return parsed
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UsageError(f"{name}={value!r}: expected {kind.__name__}")
    return value


def matches_record(name: str, given: Any, recorded: Any) -> bool:
    """Whether a recipe field as given for a run (a resume's flags, a sweep's cell) is the one the run recorded: equal,
    or an `auto` input_pipeline or -1 workers, which a run records as what they resolved to."""
    return given == recorded or (name, given) in (("input_pipeline", "auto"), ("workers", -1))


def from_dict(data: dict[str, Any]) -> TrainConfig:
    return TrainConfig().replace(**data)


def finite_float(text: str) -> float:
    """argparse type for float flags: NaN and infinity are refused where they are typed, not an epoch later."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; give a finite value")
    return value


def deit() -> TrainConfig:
    """The DeiT recipe (Touvron et al. 2021), used by the paper for widths 384 and 192.

    AdamW, lr 5e-4 x batch/512, weight decay 0.05, cosine schedule with 5 warm-up epochs, label smoothing 0.1,
    RandAugment(2, 9), MixUp 0.8 / CutMix 1.0, random erasing 0.25, 300 epochs.

        torchrun --nproc_per_node 8 -m mobile_moe train --recipe deit --model mobile-vmoe --size 12x192 \\
            --patch 32 --data imagefolder:/data/imagenet --super-classes super_classes.json --out runs/moe-12x192
    """
    return TrainConfig()


def vit() -> TrainConfig:
    """The lighter ViT recipe the paper uses for widths 96 and 64, which underfit under DeiT's heavy augmentation.

    AdamW, lr 1e-3 x batch/1024 (wd 0.1), gradient clipping at 1, 10 warm-up epochs, inception crop and flip only:
    no RandAugment, MixUp, CutMix, random erasing or label smoothing (small ViTs need capacity, not regularisation).

        torchrun --nproc_per_node 8 -m mobile_moe train --recipe vit --model mobile-vmoe --size 12x64 \\
            --patch 32 --data imagefolder:/data/imagenet --super-classes super_classes.json --out runs/moe-12x64
    """
    return TrainConfig(
        base_lr=1e-3,
        base_batch=1024,
        weight_decay=0.1,
        warmup_epochs=10.0,
        grad_clip=1.0,
        label_smoothing=0.0,
        randaugment_ops=0,
        mixup_alpha=0.0,
        cutmix_alpha=0.0,
        random_erasing=0.0,
    )


def tiny() -> TrainConfig:
    """CPU demos and tests: a few epochs on `digits` or `synthetic`, in-process data loading, light augmentation.

    Chosen so that `mobile-moe demo` trains a dense ViT and a Mobile V-MoE (4x64, patch 8, 32 px) on digits in a few
    minutes on 2 cores. No augmentation: digits are not flipped (a mirrored 2 is not a 2), and in 15 epochs a tiny ViT
    underfits 1,257 images rather than overfits (dense 4x64 reaches about 91% val top-1).

        mobile-moe train --recipe tiny --model mobile-vmoe --size 4x64 --patch 8 --image-size 32 --pool mean \\
            --experts 5 --data digits --super-classes random --out runs/digits-moe --device cpu
    """
    return TrainConfig(
        epochs=15,
        batch_size=32,
        base_lr=2e-3,
        base_batch=32,
        min_lr=1e-5,
        warmup_epochs=1.0,
        weight_decay=0.05,
        label_smoothing=0.0,
        crop_scale=1.0,
        hflip=False,
        randaugment_ops=0,
        mixup_alpha=0.0,
        cutmix_alpha=0.0,
        random_erasing=0.0,
        workers=0,
    )


def tiny_gpu() -> TrainConfig:
    """The tiny recipe's models on one GPU: batches of 1,024 at lr 5e-3 (not the tiny recipe's 2e-3 scaled linearly
    to 6.4e-2), one warm-up epoch, 10 epochs. A small ViT's step costs a GPU almost nothing whatever its batch, so
    large batches make it fast; with no augmentation, its images are computed once. On Fashion-MNIST's 54,000 training
    images a 6x64/8 ViT reached 70% and 72% val top-1 after 2 epochs at lr 2e-3 and 6e-3 (2 CPU cores, 55 s each).

        mobile-moe train --recipe tiny-gpu --model mobile-vmoe --size 6x64 --patch 8 --image-size 32 --pool mean \\
            --experts 5 --data fashion-mnist --super-classes coarse --out runs/fmnist-moe --device cuda
    """
    return tiny().replace(epochs=10, batch_size=1024, base_lr=5e-3, base_batch=1024)


RECIPES = {"deit": deit, "vit": vit, "tiny": tiny, "tiny-gpu": tiny_gpu}


def recipe(name: str) -> TrainConfig:
    if name not in RECIPES:
        raise UsageError(f"unknown recipe {name!r}: choose one of {', '.join(RECIPES)}")
    return RECIPES[name]()
