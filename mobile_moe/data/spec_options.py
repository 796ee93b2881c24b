"""The `key=value,...` options of a data spec (synthetic:..., digits-pairs:...), parsed against a frozen dataclass:
every key known, every value of its field's type (int or float), the dataclass's own checks run on the result. And the
words of a refused spec: one line naming the part that was wrong, ending with an example that opens."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from pathlib import Path
from typing import TypeVar

from mobile_moe.errors import UsageError

Spec = TypeVar("Spec")

# The data specs datasets.py opens: every --data flag's help and unknown_name's hints (here: the CLI imports it
# without torch)
DATA_SPECS = (
    "digits | digits-pairs[:k=v,...] | synthetic[:k=v,...] | fashion-mnist[:ROOT][,k=v,...] | idx:ROOT[,k=v,...] | "
    "cifar10:ROOT | cifar100:ROOT | imagefolder:ROOT | packed:STORE"
)
# One spec of each name in DATA_SPECS that opens as written (a real folder in place of /path/to/...): every refusal
# of a spec ends with one, so that the form that works stands next to the part that did not.
EXAMPLES = {
    "digits": "digits",
    "digits-pairs": "digits-pairs:train=6000,test=4000",
    "synthetic": "synthetic:classes=12,super=4",
    "fashion-mnist": "fashion-mnist,train=6000",
    "idx": "idx:/path/to/mnist,train=6000",
    "cifar10": "cifar10:/path/to/cifar-10-batches-py",
    "cifar100": "cifar100:/path/to/cifar-100-python",
    "imagefolder": "imagefolder:/path/to/photos",
    "packed": "packed:/path/to/store",
}
# Sets of IDX files someone may name as data of their own: idx:ROOT reads them (fashion-mnist alone has a name).
IDX_SETS = ("mnist", "kmnist", "emnist", "qmnist")
# The built-in real data's source images, in pixels (long side): a model far larger upsamples them to no purpose.
SOURCE_SIZE = {"digits": 8, "digits-pairs": 16, "fashion-mnist": 28, "idx": 28}


def spec_forms() -> dict[str, str]:
    """name -> its form in DATA_SPECS ("idx" -> "idx:ROOT[,k=v,...]"), read from DATA_SPECS: the one statement of
    the grammar."""
    forms = [form.strip() for form in DATA_SPECS.split("|")]
    return {re.match(r"[a-z0-9-]+", form).group(): form for form in forms}


def refusal(spec: str, problem: str, example: str) -> UsageError:
    """One line: the spec as given, what part of it is wrong (`problem`), and `example`, a spec that opens."""
    return UsageError(f"data spec {spec!r}: {problem}; e.g. --data {example}")


def unknown_name(spec: str, name: str) -> UsageError:
    """`name` is none of DATA_SPECS's: the near ones (by spelling, and idx for a set of IDX files) and an example of
    the nearest."""
    forms = spec_forms()
    head = name.partition(",")[0].lower()  # "idx,train=5": the name before a misplaced option
    near = difflib.get_close_matches(head, forms, n=2, cutoff=0.5)
    if head in IDX_SETS:
        near = ["idx", *near]
    guess = f"did you mean {' or '.join(forms[known] for known in near)}? " if near else ""
    problem = f"no data named {name!r}; {guess}names: {', '.join(forms)}"
    return refusal(spec, problem, EXAMPLES[near[0] if near else "digits"])


def parse_options(spec_class: type[Spec], argument: str, dataset: str, example: str) -> Spec:
    """ "classes=12,super=4" -> spec_class(classes=12, super=4); a bad key or value is one line naming the dataset,
    the culprit and ending with `example`."""
    fields = {field.name: field for field in dataclasses.fields(spec_class)}  # type: ignore[arg-type]
    values: dict[str, int | float] = {}
    for item in argument.split(",") if argument else []:
        key, _, value = item.partition("=")
        if not item:
            raise UsageError(f"{dataset}: an empty option (two commas, or one at the end); e.g. --data {example}")
        if key not in fields:
            raise UsageError(f"{dataset}: unknown option {key!r}; known: {', '.join(fields)}; e.g. --data {example}")
        if key in values:
            raise UsageError(f"{dataset}: {key} is given twice; give it once, e.g. --data {example}")
        kind = float if fields[key].type in (float, "float") else int
        values[key] = _option_value(dataset, key, value, kind, example)
    try:
        return spec_class(**values)
    except UsageError as error:  # the class's own check of the values: name the data, end with a spec that passes
        problem = str(error).removeprefix(f"{dataset}: ")  # synthetic's and digits-pairs' checks name theirs already
        raise UsageError(f"{dataset}: {problem}; e.g. --data {example}") from None


MAX_OPTION = 2**32 - 1  # the largest count or seed an option takes (numpy's seeds are 32-bit words)


def _option_value(dataset: str, key: str, text: str, kind: type, example: str) -> int | float:
    """One option's value: every count, seed and noise level of a data spec is a finite number from 0 up (a seed or
    count at most MAX_OPTION); each data set then checks its own bounds."""
    try:
        value = kind(text)
    except ValueError:
        raise UsageError(f"{dataset}: {key}={text!r} is not a valid {kind.__name__}; e.g. --data {example}") from None
    below_the_top = value <= MAX_OPTION if kind is int else value < math.inf
    if not (0 <= value and below_the_top):  # NaN fails every comparison
        bound = f"an integer from 0 to {MAX_OPTION}" if kind is int else "a finite number from 0 up"
        raise UsageError(f"{dataset}: {key}={text} must be {bound}; e.g. --data {example}")
    return value


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
        items = [os.path.abspath(os.path.expanduser(item)) if _is_folder_item(item) else item
                 for item in argument.split(",")]  # fmt: skip
        return f"{name}{separator}{','.join(items)}"
    return spec


def spec_folder(spec: str) -> Path | None:
    """The folder a data spec reads (made absolute, as resolved_spec makes it); None for data without one."""
    name, _, argument = resolved_spec(spec).partition(":")
    if name in FOLDER_SPECS and argument:
        return Path(argument)
    if name in OPTIONED_FOLDER_SPECS:
        return next((Path(item) for item in argument.split(",") if _is_folder_item(item)), None)
    return None


def _is_folder_item(item: str) -> bool:
    """Whether an item of an optioned folder spec (NAME:ROOT,k=v,...) is its ROOT: the one without "="."""
    return bool(item) and "=" not in item


def same_data(given: str, recorded: str | None) -> bool:
    """Whether data spec `given` names the data a run recorded as `recorded` (both resolved: a relative folder given
    from the run's own directory is the run's)."""
    return recorded is not None and resolved_spec(given) == resolved_spec(recorded)
