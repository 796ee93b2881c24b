"""The `key=value,...` options of a data spec (synthetic:..., digits-pairs:...), parsed against a frozen dataclass:
every key known, every value of its field's type (int or float), the dataclass's own checks run on the result."""

from __future__ import annotations

import dataclasses
import os
from typing import TypeVar

from mobile_moe.errors import UsageError

Spec = TypeVar("Spec")

# The data specs data.py opens: every --data flag's help and data.py's refusal (here: the CLI imports it without torch)
DATA_SPECS = (
    "digits | digits-pairs[:k=v,...] | synthetic[:k=v,...] | fashion-mnist[:ROOT][,k=v,...] | idx:ROOT[,k=v,...] | "
    "cifar10:ROOT | cifar100:ROOT | imagefolder:ROOT | packed:STORE"
)
# The built-in real data's source images, in pixels (long side): a model far larger upsamples them to no purpose.
SOURCE_SIZE = {"digits": 8, "digits-pairs": 16, "fashion-mnist": 28, "idx": 28}


def parse_options(spec_class: type[Spec], argument: str, dataset: str, example: str) -> Spec:
    """ "classes=12,super=4" -> spec_class(classes=12, super=4); a bad key or value is one line naming the dataset."""
    fields = {field.name: field for field in dataclasses.fields(spec_class)}  # type: ignore[arg-type]
    values: dict[str, int | float] = {}
    for item in filter(None, argument.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise UsageError(f"{dataset}: unknown option {key!r}; known: {', '.join(fields)} (e.g. {example})")
        kind = float if fields[key].type in (float, "float") else int
        try:
            values[key] = kind(value)
        except ValueError:
            raise UsageError(f"{dataset}: {key}={value!r} is not a valid {kind.__name__}") from None
    return spec_class(**values)


FOLDER_SPECS = ("imagefolder", "packed", "cifar10", "cifar100")  # NAME:ROOT, the whole argument a folder
OPTIONED_FOLDER_SPECS = ("idx", "fashion-mnist")  # NAME:ROOT,k=v,...: ROOT the one item without "="


def resolved_spec(spec: str) -> str:
    """`spec` with its folder made absolute, as a run records it: a command run later from another directory reads
    the same folder, never another one of the same relative name. Specs without a folder come back as they are."""
    name, separator, argument = spec.partition(":")
    if not argument:
        return spec
    if name in FOLDER_SPECS:
        return f"{name}:{os.path.abspath(os.path.expanduser(argument))}"
    if name in OPTIONED_FOLDER_SPECS:
        items = [item if "=" in item or not item else os.path.abspath(os.path.expanduser(item))
                 for item in argument.split(",")]  # fmt: skip
        return f"{name}{separator}{','.join(items)}"
    return spec


def same_data(given: str, recorded: str | None) -> bool:
    """Whether data spec `given` names the data a run recorded as `recorded` (both resolved: a relative folder given
    from the run's own directory is the run's)."""
    return recorded is not None and resolved_spec(given) == resolved_spec(recorded)
