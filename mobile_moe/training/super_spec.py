"""Super-class specs for training -> a validated `SuperClasses` (or None):

    FILE.json        a super-class file (mobile_moe/super_class/ derives them from a dense model's confusions)
    coarse | truth   the dataset's own: CIFAR-100's 20 coarse labels, digits-pairs' tens digit, Fashion-MNIST's
                     five kinds (tops, footwear, trouser, dress, bag), synthetic's planted hierarchy
    random[:SEED]    the paper's random-class ablation: classes shuffled into E near-equal groups

The classes must be the data's (same names, same order) and the number of super-classes must be the model's E.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mobile_moe.data.datasets import Data
from mobile_moe.errors import UsageError
from mobile_moe.formats.superclasses import (
    SuperClasses,
    load,
    random_super_classes,
    unnamed_classes,
    validate,
)
from mobile_moe.models.config import ViTConfig

DATASET_SOURCES = ("coarse", "truth", "dataset")
SPEC_HELP = "FILE.json, coarse (CIFAR-100, digits-pairs, fashion-mnist), truth (synthetic) or random[:SEED]"


def parse_random(spec: str) -> int | None:
    """ "random" -> 0, "random:7" -> 7, anything else -> None."""
    name, _, seed = spec.partition(":")
    if name != "random":
        return None
    try:
        return int(seed) if seed else 0
    except ValueError:
        raise UsageError(f"super-classes {spec!r}: the seed must be an integer (random:SEED)") from None


def resolve_super_classes(spec: str | None, data: Data, model_config: ViTConfig) -> SuperClasses | None:
    num_experts = getattr(model_config, "num_experts", None)
    if spec is None or spec == "none":
        return None
    if num_experts is None:
        raise UsageError(f"--super-classes {spec}: the dense model {model_config.name!r} has no router; drop it")
    seed = parse_random(spec)
    if seed is not None:
        super_classes = random_super_classes(data.class_names, num_experts, seed)
    elif spec in DATASET_SOURCES:
        if data.super_classes is None:
            raise UsageError(f"--super-classes {spec}: {data.spec} provides no super-classes; use {SPEC_HELP}")
        super_classes = data.super_classes
    elif spec.endswith(".json") or Path(spec).exists():
        super_classes = load(spec)
    else:
        raise UsageError(f"--super-classes {spec!r}: use {SPEC_HELP}")
    check_matches(super_classes, spec, data, num_experts)
    return super_classes


def check_matches(super_classes: SuperClasses, spec: str, data: Data, num_experts: int) -> None:
    if super_classes.num_classes != data.num_classes:
        raise UsageError(
            f"super-classes {spec}: {super_classes.num_classes} classes, but {data.spec} has {data.num_classes}; "
            "derive them on the same data"
        )
    if super_classes.class_names == unnamed_classes(data.num_classes) != list(data.class_names):
        raise UsageError(
            f"super-classes {spec}: its classes have no names ('class 0', ...: derived from a confusion matrix without "
            f"them), but {data.spec} names them ({data.class_names[0]!r}, ...); derive them again with --class-names "
            f"FILE (the {data.num_classes} class names of {data.spec}, one per line, in order)"
        )
    if list(super_classes.class_names) != list(data.class_names):
        pairs = enumerate(zip(super_classes.class_names, data.class_names, strict=True))
        diff = next(i for i, (a, b) in pairs if a != b)
        raise UsageError(
            f"super-classes {spec}: class {diff} is {super_classes.class_names[diff]!r} there but "
            f"{data.class_names[diff]!r} in {data.spec}; derive them on the same data"
        )
    problem = count_problem(super_classes.num_super_classes, num_experts)
    if problem:
        raise UsageError(
            f"super-classes {spec}: {problem}; use --experts {super_classes.num_super_classes} or derive {num_experts} "
            "super-classes"
        )


def count_problem(num_super_classes: int, num_experts: int | None) -> str | None:
    """The router learns one expert per super-class: their counts must agree (None: a model without experts)."""
    if num_experts is None or num_super_classes == num_experts:
        return None
    return f"{num_super_classes} super-classes for a model with E={num_experts} experts"


def super_record(spec: str, super_classes: SuperClasses | None) -> dict[str, Any] | None:
    """config.json's "super_classes" entry."""
    if super_classes is None:
        return None
    return {"spec": spec, "names": list(super_classes.names), "assignment": list(super_classes.assignment)}


def super_record_problem(record: dict[str, Any], class_names: list[str], num_experts: int | None) -> str | None:
    """The first way config.json's "super_classes" entry (super_record's) departs from the super-class file's rules
    for the run's classes (superclasses.validate: the one owner of them) and its model's experts, or None."""
    names, assignment = record.get("names"), record.get("assignment")
    if not isinstance(record.get("spec"), str) or not isinstance(names, list):
        return "super_classes must hold a spec string, a list of names and an assignment"
    counted_wrong = count_problem(len(names), num_experts)
    if counted_wrong:
        return f"super_classes: {counted_wrong}"
    if isinstance(assignment, list) and len(assignment) != len(class_names):
        return f"super_classes: assignment has {len(assignment)} entries for the run's {len(class_names)} classes"
    try:  # the spec is the command line's (a path, "coarse", ...), no part of the file's rules
        validate({"num_super_classes": len(names), "names": names, "assignment": assignment,
                  "class_names": class_names, "method": "recorded", "source": "config.json"})  # fmt: skip
    except UsageError as error:
        return f"super_classes: {error}"
    return None
