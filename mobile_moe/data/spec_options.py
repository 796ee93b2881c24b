"""The `key=value,...` options of a data spec (synthetic:..., digits-pairs:...), parsed against a frozen dataclass:
every key known, every value of its field's type (int or float), the dataclass's own checks run on the result."""

from __future__ import annotations

import dataclasses
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
