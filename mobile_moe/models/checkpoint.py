"""Checkpoints are plain dicts ({"version": RUN_VERSION, "model": state_dict, "config": dict, ...}) saved with
torch.save and loaded with weights_only=True; a model is rebuilt from its `config` entry alone."""

from __future__ import annotations

import errno
import os
import warnings
from typing import Any

import torch
from torch import nn

from mobile_moe.errors import UsageError
from mobile_moe.formats.versions import check_version
from mobile_moe.models.registry import model_from_config_dict
from mobile_moe.utils.atomic import atomic_path, out_of_space
from mobile_moe.utils.words import shown

# The run directory's format version (docs/formats.md): its config.json states it (training.run_dir.read_config checks
# it), and so does every checkpoint written into it (save_checkpoint writes it, load_checkpoint checks it).
RUN_VERSION = 1

NOT_OURS = (
    "not a mobile-moe checkpoint or corrupted (it is loaded with weights_only=True and is never unpickled unsafely)"
)


def checkpoint_dict(model: nn.Module, **extra: Any) -> dict[str, Any]:
    """{"model": state_dict, "config": the model's config as a dict, **extra} (optimizer, epoch, ... from training)."""
    return {"model": model.state_dict(), "config": model.config.to_dict(), **extra}


def save_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Atomically write a checkpoint dict (temp file + rename), stating the run format's version (RUN_VERSION), whatever
    the dict states."""
    with atomic_path(path) as tmp:
        try:
            torch.save({"version": RUN_VERSION, **{k: v for k, v in checkpoint.items() if k != "version"}}, tmp)
        except (OSError, RuntimeError) as error:
            # torch's zip writer reports a full disk as "[enforce fail at inline_container.cc...] unexpected pos":
            # said as the OSError it was, atomic_path gives the one line every full disk gets.
            if out_of_space(tmp):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None
            raise UsageError(f"cannot write checkpoint {path}: {first_reason(error)}") from None


def first_reason(error: Exception) -> str:
    """The underlying error's own reason, one short line. torch's weights-only failure wraps it in paragraphs that end
    in "re-run with weights_only=False": the one advice a file that failed the safe load must not be given."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    line = line.split(". ", 1)[0].rstrip(".")[:200]
    if not line or "weights_only" in line:
        return error.__class__.__name__
    return f"{error.__class__.__name__}: {line}"


def torch_load(path: str | os.PathLike, *, map_location: str | torch.device = "cpu", mmap: bool = False) -> Any:
    """torch.load(weights_only=True): every reader of a torch file goes through here. Its UserWarnings are silenced:
    a foreign file's notes (torch/_weights_only_unpickler.py's "Detected pickle protocol ...", serialization.py's
    sparse-tensor validation) would print above the one line that says what is wrong with the file, or say nothing
    to a user whose file is fine."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def load_checkpoint(
    path: str | os.PathLike, map_location: str | torch.device = "cpu", mmap: bool = False
) -> dict[str, Any]:
    """The checkpoint dict at `path`, or one UsageError line. `mmap`: tensors stay in the file until touched, for
    callers that only read its small entries (the epoch) of a checkpoint that may hold gigabytes of optimizer state."""
    try:
        checkpoint = torch_load(path, map_location=map_location, mmap=mmap)
    except FileNotFoundError:
        raise UsageError(f"checkpoint {path} does not exist") from None
    except IsADirectoryError:
        raise UsageError(f"checkpoint {path} is a directory; give a checkpoint file") from None
    except Exception as error:  # torch raises several types for corrupt or foreign files
        raise UsageError(f"cannot read checkpoint {path}: {NOT_OURS}; {first_reason(error)}") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("model"), dict) or "config" not in checkpoint:
        raise UsageError(f"{path} is not a mobile-moe checkpoint: expected a dict with 'model' and 'config'")
    again = "train or import the run again into a new --out"
    check_version(checkpoint, RUN_VERSION, where=str(path), what="a checkpoint", fix=again)
    problem = next((f"{key} {checkpoint[key]!r}" for key, fits in METADATA.items()
                    if key in checkpoint and not fits(checkpoint[key])), None)  # fmt: skip
    if problem is not None:
        raise UsageError(f"{path}: its {problem} is out of range; the file was damaged or edited: use another one")
    if not mmap:  # a mapped checkpoint is read for its small entries only; its weights stay on disk unread
        check_finite_weights(checkpoint["model"], path, map_location)
    return checkpoint


# The dtypes a state dict's weights may be stored in, a run's checkpoint and an imported one alike: every model holds
# its weights (and a Hard MoE its cluster buffers) in float32, and trained ViTs are saved in these. No model of ours
# holds an integer, a bool, a float64, a float8 or a quantized entry: one is a damaged or edited file, which
# load_state_dict would copy in silently (a float64 of 1e300 as an infinity).
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TENSOR_TYPES = (torch.Tensor, nn.Parameter)  # a tensor subclass (a jagged NestedTensor, ...) is no weight


def weight_kind_problem(tensor: torch.Tensor, device: str | torch.device = "cpu") -> str | None:
    """Why `tensor` is not a weight a model can hold, from its kind alone (its values untouched): "a nested tensor",
    "a sparse_coo tensor", "a tensor on the meta device", "an int64 tensor", ...; None when it is
    a dense (strided) tensor of WEIGHT_DTYPES on `device` (where the checkpoint was mapped). Each test reads only what
    the ones before it made safe to read: torch's own ops fail on a nested, sparse, meta or float8 tensor."""
    if type(tensor) not in TENSOR_TYPES or tensor.is_nested:
        return "a nested tensor" if tensor.is_nested else f"a {type(tensor).__name__} tensor"
    if tensor.layout != torch.strided:
        return f"a {str(tensor.layout).removeprefix('torch.')} tensor"
    if tensor.device.type == "meta":
        return "a tensor on the meta device"
    if tensor.device.type != torch.device(device).type:
        return f"a tensor on the {tensor.device.type} device"
    if tensor.is_complex():
        return "a complex tensor"
    if tensor.dtype not in WEIGHT_DTYPES:
        name = str(tensor.dtype).removeprefix("torch.")
        return f"{'an' if name.startswith('int') else 'a'} {name} tensor"
    return None


def not_finite(tensor: torch.Tensor) -> bool:
    """Whether a floating-point tensor holds a NaN or an infinity: the one test of a weight's values, for a tensor
    weight_kind_problem has passed (torch's own ops fail on a nested, sparse, meta or float8 one)."""
    return tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())


def check_finite_weights(state: dict[str, Any], path: str | os.PathLike, device: str | torch.device = "cpu") -> None:
    """UsageError naming the first weight of `state` that is not of a kind a model holds (weight_kind_problem: nested,
    sparse, meta, complex, integer, float8, ...: torch's own checks fail on it, drop its imaginary part or copy it in
    silently), then the first one that holds a NaN or an infinity: a model loaded from it would evaluate to chance,
    and export would fail parity, without saying why. `device`: where the checkpoint was mapped to."""
    tensors = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
    odd = next(((key, why) for key, value in tensors.items() if (why := weight_kind_problem(value, device))), None)
    if odd is not None:
        raise UsageError(f"{path}: weight {_shown_key(odd[0])} is {odd[1]}, which no model holds (a damaged or edited "
                         "file); use another checkpoint, or train or import the run again")  # fmt: skip
    bad = next((key for key, value in tensors.items() if not_finite(value)), None)
    if bad is not None:
        raise UsageError(
            f"{path}: weight {_shown_key(bad)} holds NaN or infinite values (a diverged run, or a damaged file); use "
            "an earlier checkpoint, or train again with a lower learning rate"
        )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _share(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= 1.0  # NaN fails too


# The training metadata a checkpoint may carry (mobile_moe/training/train.py writes them): the one check of what is read
# back.
METADATA = {"epoch": _count, "best_epoch": _count, "best_top1": _share}


def state_mismatches(expected: dict[str, Any], state_dict: dict[str, Any]) -> list[str]:
    """How `state_dict` fails to fit a model whose state dict is `expected`: "N missing (e.g. KEY)", "N unexpected
    (...)", "N of another shape (...)"; empty when it fits."""
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    shapes = [
        key
        for key in expected
        if key in state_dict
        and (not isinstance(state_dict[key], torch.Tensor) or state_dict[key].shape != expected[key].shape)
    ]
    return [
        f"{len(keys)} {what} (e.g. {_shown_key(keys[0])})"
        for keys, what in ((missing, "missing"), (unexpected, "unexpected"), (shapes, "of another shape"))
        if keys
    ]


def _shown_key(key: Any) -> str:
    """A state-dict key for an error line: a forged one may be any length and hold a newline or an escape code."""
    return shown(key if isinstance(key, str) else repr(key), 100)


def load_weights(model: nn.Module, state_dict: dict[str, Any], source: str | os.PathLike) -> None:
    """model.load_state_dict, with a state dict that does not fit the model reported in one line (what and where)."""
    expected = model.state_dict()
    problems = state_mismatches(expected, state_dict)
    if problems:
        raise UsageError(
            f"{source}: its weights do not fit its {model.config.name} config ({len(expected)} tensors expected; "
            f"{', '.join(problems)}); the file was damaged or edited: use another checkpoint or retrain"
        )
    try:
        model.load_state_dict(state_dict)
    except (RuntimeError, ValueError, TypeError) as error:  # e.g. a dtype torch cannot copy
        raise UsageError(f"{source}: cannot load its weights: {first_reason(error)}") from None


def model_from_checkpoint(checkpoint: dict[str, Any], source: str | os.PathLike = "checkpoint") -> nn.Module:
    """Rebuild the model from `checkpoint["config"]` and load its weights (`source` names the file in errors)."""
    config = checkpoint["config"]
    try:
        model = model_from_config_dict(config if isinstance(config, dict) else {})
    except UsageError as error:
        raise UsageError(f"{source}: its model config is not valid ({error})") from None
    load_weights(model, checkpoint["model"], source)
    return model
