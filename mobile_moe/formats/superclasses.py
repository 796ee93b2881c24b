"""The super-class file (docs/formats.md): which of E super-classes each of C classes belongs to.

    {"version": 1, "num_super_classes": E, "assignment": [C ints in 0..E-1, every index used], "class_names": [C],
     "names": [E], "method": "spectral" | "louvain" | "balanced" | "dataset" | "random", "source": str,
     "quality": {...} | null}

Every source (clustering, dataset labels, random) produces a `SuperClasses`; training reads a file back with `load`.
The file's rules are written once, in `SuperClassFile` (field types and ranges, and the rules that tie fields
together); `validate` is the one entry point, used by `load` and by `SuperClasses` itself, and turns any problem into
a UsageError of one line. A file states its format version (VERSION); `load` refuses another, or none, before the
rules.
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from mobile_moe.errors import UsageError
from mobile_moe.formats.versions import check_version
from mobile_moe.utils.atomic import write_text_atomic
from mobile_moe.utils.class_names import class_names_problem
from mobile_moe.utils.foreign_files import read_foreign_text
from mobile_moe.utils.jsonio import dumps
from mobile_moe.utils.words import has_control_character

VERSION = 1  # the super-class file's format version: every file states it, `load` reads this one only
MAX_CLASSES = 1 << 20  # classes (and so super-classes) a file may name
MAX_FILE_BYTES = 256 << 20  # far beyond 1M classes' worth of names; refuses a runaway file before reading it


def _printable(text: str) -> str:
    """Text `superclass show`, train and export print or copy on: a control character would forge a line or a colour."""
    if has_control_character(text):
        raise ValueError(f"{text[:40]!r} holds a control character (a newline, tab or escape): rename it")
    return text


Index = Annotated[int, Field(ge=0, lt=MAX_CLASSES)]
Text = Annotated[str, Field(max_length=4096), AfterValidator(_printable)]
Share = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


class _Strict(BaseModel):
    # strict: 1.0, "1" and true are not integers, null is not a list; extra keys are kept (newer tools may add facts).
    model_config = ConfigDict(strict=True, extra="allow")


class Quality(_Strict):
    """The measured quality (super_class.quality writes it); every field is optional, null where it is undefined."""

    within_confusion_share: Share | None = None
    within_affinity_share: Share | None = None
    chance_share: Share | None = None
    chance_share_std: Share | None = None
    balance: Share | None = None
    sizes: Annotated[list[Index], Field(max_length=MAX_CLASSES)] | None = None
    size_min: Index | None = None
    size_max: Index | None = None
    classes_without_images: Annotated[list[Index], Field(max_length=MAX_CLASSES)] = []
    seed: int | None = None
    affinity: Text | None = None


class SuperClassFile(_Strict):
    num_super_classes: Annotated[int, Field(ge=2, le=MAX_CLASSES)]
    assignment: Annotated[list[Index], Field(min_length=2, max_length=MAX_CLASSES)]
    class_names: Annotated[list[Text], Field(max_length=MAX_CLASSES)]
    names: Annotated[list[Text], Field(max_length=MAX_CLASSES)]
    method: Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_printable)]
    source: Text
    quality: Quality | None = None

    @model_validator(mode="after")
    def _consistent(self) -> SuperClassFile:
        num_classes, num = len(self.assignment), self.num_super_classes
        problem = class_names_problem(self.class_names)
        if problem:
            raise ValueError(problem)
        if len(self.class_names) != num_classes:
            raise ValueError(f"{len(self.class_names)} class names for {num_classes} classes; give one name per class")
        if len(self.names) != num:
            raise ValueError(f"num_super_classes is {num} but there are {len(self.names)} names; one per super-class")
        if num > num_classes:
            raise ValueError(f"{num} super-classes for {num_classes} classes; need at most one per class")
        bad = sorted({s for s in self.assignment if s >= num})
        if bad:
            raise ValueError(f"assignment uses {bad[:10]}, outside 0..{num - 1}")
        unused = sorted(set(range(num)) - set(self.assignment))
        if unused:
            raise ValueError(f"super-class(es) {unused[:10]} have no classes; every index must be used")
        quality = self.quality
        if quality is not None:
            if quality.sizes is not None and len(quality.sizes) != num:
                raise ValueError(f"quality.sizes has {len(quality.sizes)} entries for {num} super-classes")
            missing = [c for c in quality.classes_without_images if c >= num_classes]
            if missing:
                raise ValueError(f"quality.classes_without_images names class {missing[0]}; there are {num_classes}")
        return self


def validate(data: Any) -> SuperClassFile:
    """The parsed file, or a UsageError with ONE line: where in the file, and what is wrong."""
    try:
        return SuperClassFile.model_validate(data)
    except ValidationError as error:
        first = error.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        more = f" (and {error.error_count() - 1} more problems)" if error.error_count() > 1 else ""
        raise UsageError(f"{where + ': ' if where else ''}{message}{more}") from None


def _plain(value: Any) -> Any:
    """numpy scalars and str subclasses as the plain Python values the strict schema expects (bool stays bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral | str):
        return value
    return str(value) if isinstance(value, str) else int(value)


@dataclass
class SuperClasses:
    assignment: list[int]  # assignment[c] = super-class of class c
    class_names: list[str]
    names: list[str]  # one per super-class
    method: str
    source: str
    quality: dict[str, Any] | None = field(default=None)

    def __post_init__(self) -> None:
        self.assignment = [_plain(s) for s in self.assignment]
        self.class_names = [_plain(n) for n in self.class_names]
        self.names = [_plain(n) for n in self.names]
        try:
            validate(self.to_dict())
        except UsageError as error:
            raise UsageError(f"super-classes: {error}") from None

    @property
    def num_super_classes(self) -> int:
        return len(self.names)

    @property
    def num_classes(self) -> int:
        return len(self.assignment)

    def members(self, super_class: int) -> list[int]:
        return [c for c, s in enumerate(self.assignment) if s == super_class]

    def to_dict(self) -> dict[str, Any]:
        """The super-class file's content: its format version first."""
        return {"version": VERSION, "num_super_classes": self.num_super_classes, **asdict(self)}

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, dumps(self.to_dict(), indent=2) + "\n")


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def load(path: str | os.PathLike) -> SuperClasses:
    """Read and validate a super-class file; any problem is a UsageError of one line naming the file.

    The one reader of super-class files (training reads them through it): a missing file, a directory or FIFO (never
    opened, so never waited on), text that is not JSON (NaN, nesting too deep, a number too long), a file of another
    format version than VERSION (or of none), and a file that breaks `SuperClassFile`'s rules are all refused.
    """
    path = Path(path)
    if not path.exists():
        raise UsageError(f"super-class file {path} does not exist")
    if not path.is_file():
        raise UsageError(f"super-class file {path} is not a regular file; give a .json file")
    try:
        text = read_foreign_text(path, limit=MAX_FILE_BYTES, what="super-class file")
        data = json.loads(text, parse_constant=_refuse_constant)
    except UnicodeDecodeError as error:
        raise UsageError(f"cannot read super-class file {path}: {error}") from None
    except RecursionError:
        raise UsageError(f"super-class file {path} is not valid JSON: nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, NaN/Infinity, an integer too long to convert
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UsageError(f"super-class file {path} is not valid JSON: {message}") from None
    required = ("num_super_classes", "assignment", "class_names", "names", "method", "source")
    if isinstance(data, dict) and ("version" in data or all(key in data for key in required)):
        check_version(data, VERSION, where=str(path), what="a super-class file",
                      fix="derive it again (mobile-moe superclass derive)")  # fmt: skip
    if not isinstance(data, dict) or any(key not in data for key in required):
        raise UsageError(f"{path} is not a super-class file: it needs the keys {', '.join(required)}")
    try:
        checked = validate(data)
    except UsageError as error:
        raise UsageError(f"super-class file {path}: {error}") from None
    return SuperClasses(
        assignment=list(checked.assignment),
        class_names=list(checked.class_names),
        names=list(checked.names),
        method=checked.method,
        source=checked.source,
        quality=data.get("quality"),
    )


def default_names(num_super_classes: int) -> list[str]:
    return [f"super-class {i}" for i in range(num_super_classes)]


def unnamed_classes(num_classes: int) -> list[str]:
    """The class names of a confusion matrix read without any ("class 0", "class 1", ...)."""
    return [f"class {c}" for c in range(num_classes)]


def random_super_classes(class_names: list[str], num_super_classes: int, seed: int = 0) -> SuperClasses:
    """The paper's "random class" ablation: classes shuffled into E groups of near-equal size, seeded."""
    import random

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
