"""The super-class file (DESIGN.md): which of E super-classes each of C classes belongs to.

    {"num_super_classes": E, "assignment": [C ints in 0..E-1, every index used], "class_names": [C], "names": [E],
     "method": "spectral" | "louvain" | "balanced" | "dataset" | "random", "source": str, "quality": {...} | null}

Every source (clustering, dataset labels, random) produces a `SuperClasses`; training reads it back with `load`.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from mobile_moe.atomic import write_text_atomic
from mobile_moe.errors import UsageError


@dataclass
class SuperClasses:
    assignment: list[int]  # assignment[c] = super-class of class c
    class_names: list[str]
    names: list[str]  # one per super-class
    method: str
    source: str
    quality: dict[str, Any] | None = field(default=None)

    def __post_init__(self) -> None:
        num = len(self.names)
        if len(self.class_names) != len(self.assignment):
            raise UsageError(
                f"super-classes: {len(self.class_names)} class names for {len(self.assignment)} classes; "
                "give one name per class"
            )
        if num < 2:
            raise UsageError(f"super-classes: {num} super-class(es); need at least 2")
        bad = sorted({s for s in self.assignment if not (isinstance(s, int) and 0 <= s < num)})
        if bad:
            raise UsageError(f"super-classes: assignment uses {bad}, outside 0..{num - 1}")
        unused = sorted(set(range(num)) - set(self.assignment))
        if unused:
            raise UsageError(f"super-classes: super-class(es) {unused} have no classes; every index must be used")

    @property
    def num_super_classes(self) -> int:
        return len(self.names)

    @property
    def num_classes(self) -> int:
        return len(self.assignment)

    def members(self, super_class: int) -> list[int]:
        return [c for c, s in enumerate(self.assignment) if s == super_class]

    def to_dict(self) -> dict[str, Any]:
        return {"num_super_classes": self.num_super_classes, **asdict(self)}

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")


def load(path: str | os.PathLike) -> SuperClasses:
    """Read and validate a super-class file; any problem is a UsageError naming the file."""
    try:
        data = json.loads(open(path).read())
    except FileNotFoundError:
        raise UsageError(f"super-class file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read super-class file {path}: {error}") from None
    required = ("num_super_classes", "assignment", "class_names", "names", "method", "source")
    if not isinstance(data, dict) or any(key not in data for key in required):
        raise UsageError(f"{path} is not a super-class file: it needs the keys {', '.join(required)}")
    try:
        result = SuperClasses(
            assignment=list(data["assignment"]),
            class_names=list(data["class_names"]),
            names=list(data["names"]),
            method=data["method"],
            source=data["source"],
            quality=data.get("quality"),
        )
    except UsageError as error:
        raise UsageError(f"{path}: {error}") from None
    if result.num_super_classes != data["num_super_classes"]:
        raise UsageError(f"{path}: num_super_classes={data['num_super_classes']} but {len(result.names)} names")
    return result


def default_names(num_super_classes: int) -> list[str]:
    return [f"super-class {i}" for i in range(num_super_classes)]


def random_super_classes(class_names: list[str], num_super_classes: int, seed: int = 0) -> SuperClasses:
    """The paper's "random class" ablation: classes shuffled into E groups of near-equal size, seeded."""
    if not 2 <= num_super_classes <= len(class_names):
        raise UsageError(f"num_super_classes={num_super_classes}: must be between 2 and {len(class_names)} classes")
    order = list(range(len(class_names)))
    random.Random(seed).shuffle(order)
    assignment = [0] * len(class_names)
    for rank, c in enumerate(order):
        assignment[c] = rank % num_super_classes
    return SuperClasses(assignment, list(class_names), default_names(num_super_classes), "random", f"random:{seed}")


def from_labels(assignment: list[int], class_names: list[str], names: list[str], source: str) -> SuperClasses:
    """Super-classes a dataset provides (e.g. CIFAR-100's 20 coarse labels, or a synthetic dataset's planted ones)."""
    return SuperClasses(list(assignment), list(class_names), list(names), "dataset", source)
