"""A file of class names given on the command line (`--class-names`): one name per line, or a JSON list of strings
(a .json file). One reader for every command that takes one (superclass derive, import), and one rule for what a list
of class names is (class_names_problem), and one for data that must have a model's classes (check_classes)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

from mobile_moe.errors import UsageError
from mobile_moe.utils.words import has_control_character


class ClassifiedData(Protocol):
    """What check_classes reads of an opened data spec (mobile_moe.data.datasets.Data, which imports this module)."""

    spec: str
    class_names: list[str]

    @property
    def num_classes(self) -> int: ...


def read_class_names(path: str | os.PathLike) -> list[str]:
    """The names in `path`, or one UsageError line. Never opens a FIFO or device (it could block)."""
    path = str(path)
    if not Path(path).exists():
        raise UsageError(f"--class-names {path} does not exist; give a file with one class name per line")
    if not Path(path).is_file():
        raise UsageError(f"--class-names {path} is not a regular file; give a file with one class name per line")
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is not a name's
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read --class-names {path}: {error}") from None
    if path.endswith(".json"):
        try:
            names = json.loads(text)
        except RecursionError:
            raise UsageError(f"--class-names {path}: not JSON: nested too deeply") from None
        except ValueError as error:  # JSONDecodeError, or an integer too long to convert
            raise UsageError(f"--class-names {path}: not JSON: {error}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise UsageError(f"--class-names {path}: expected a JSON list of strings")
    else:
        names = [line for line in text.splitlines() if line.strip()]
    names = [name.strip() for name in names]
    problem = class_names_problem(names)
    if problem is not None:
        raise UsageError(f"--class-names {path}: {problem}")
    return names


def class_names_problem(names: Any) -> str | None:
    """The first way `names` is not a list of class names, or None: the one rule for a run's data record, an image
    folder's class folders, an import's --class-names, a bundle's manifest and every other list of class names read
    back. Non-empty; each a non-blank string of UTF-8 text without control characters (a newline or an escape code
    would forge a line or a colour where a command prints the name); no name twice. (A names file's names are
    stripped of surrounding spaces as they are read; a folder's names are its own.)"""
    if not isinstance(names, list) or not names:
        return "the class names must be a non-empty list"
    for index, name in enumerate(names):
        if not isinstance(name, str) or not name.strip():
            return f"class name {index + 1} ({name!r}) is blank or not a string"
        if has_control_character(name):
            return f"class name {index + 1} ({name!r}) holds a control character (a newline, tab or escape): rename it"
        if not name.isascii() and _undecodable(name):
            return f"class name {index + 1} ({name!r}) is not UTF-8 text (a folder name in another encoding): rename it"
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        return f"class name {twice!r} appears more than once"
    return None


def _undecodable(name: str) -> bool:
    """A name the OS gave in bytes that are not UTF-8 (Python keeps them as surrogate escapes): no manifest, JSON or
    plot can hold it."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_classes(class_names: list[str], data: ClassifiedData, *, whose: str, fix: str) -> None:
    """`data` (an opened data spec) must classify exactly `class_names`, in order: a model's outputs mean those
    classes, and its routing was learnt on their images. `whose`: the model ("the run in RUN"); `fix`: what to do."""
    theirs, ours = list(data.class_names), list(class_names)
    if theirs != ours:
        shorter = min(len(theirs), len(ours))  # where they part when one list begins the other
        index = next((i for i in range(shorter) if theirs[i] != ours[i]), shorter)
        raise UsageError(
            f"--data {data.spec} has {data.num_classes} classes ({', '.join(theirs[:3])}, ...) that are not the "
            f"{len(ours)} of {whose} ({', '.join(ours[:3])}, ...): its class {index + 1} is {_named(theirs, index)} "
            f"where {whose} has {_named(ours, index)}; {fix}"
        )


def _named(names: list[str], index: int) -> str:
    return repr(names[index]) if index < len(names) else "none"
