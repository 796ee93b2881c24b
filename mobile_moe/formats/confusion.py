"""Confusion matrices (rows = true class, columns = predicted class): from predictions, read from a file or written
to one (.npy, or .csv with a header of class names: one reader and one writer of both).

Soft confusion (the default when a model is given) adds each image's whole softmax vector to its true class's row;
hard confusion adds 1 at the argmax. With few validation images per class, the soft matrix still says which classes a
model finds similar when the argmax is right, so it carries far more signal per image (the issue's "real case").
"""

from __future__ import annotations

import csv
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mobile_moe.errors import UsageError
from mobile_moe.utils.atomic import atomic_path, check_replaceable
from mobile_moe.utils.devices import memory_limit, over_memory_limit
from mobile_moe.utils.foreign_files import read_foreign_text


@dataclass
class Confusion:
    matrix: np.ndarray  # (C, C), rows = true class
    class_names: list[str]
    source: str  # where it came from, recorded in the super-class file


def confusion_from_predictions(probs, labels, hard: bool = False, num_classes: int | None = None) -> np.ndarray:
    """(C, C) float64 matrix from `probs` (N, C) softmax probabilities and `labels` (N,) true class indices.

    Accepts numpy arrays or torch tensors. Hard: counts of (true, argmax); soft: sums of probability vectors, so every
    row sums to the number of images of that class either way.
    """
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels)
    if probs.ndim != 2 or probs.shape[0] == 0 or probs.shape[1] == 0:
        raise UsageError(f"predictions: probs must be (N, C) with N, C > 0, got shape {probs.shape}")
    if labels.shape != (probs.shape[0],):
        raise UsageError(f"predictions: labels must be ({probs.shape[0]},) to match probs, got shape {labels.shape}")
    num_classes = probs.shape[1] if num_classes is None else num_classes
    if probs.shape[1] != num_classes:
        raise UsageError(f"predictions: probs has {probs.shape[1]} columns for {num_classes} classes")
    if not np.all(np.isfinite(probs)) or probs.min() < 0 or not np.allclose(probs.sum(1), 1.0, atol=1e-3):
        raise UsageError("predictions: probs rows must be finite and sum to 1 (pass softmax probabilities, not logits)")
    if not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() >= num_classes:
        raise UsageError(f"predictions: labels must be integers in 0..{num_classes - 1}")
    confusion = np.zeros((num_classes, num_classes))
    if hard:
        np.add.at(confusion, (labels, probs.argmax(1)), 1.0)
    else:
        np.add.at(confusion, labels, probs)  # row labels[n] += probs[n]
    return confusion


def confusion_matrix(matrix, what: str = "confusion matrix") -> np.ndarray:
    """The matrix as float64 (C, C) of finite non-negative numbers, or a UsageError saying what is wrong with it: what
    a confusion file holds, whatever it is used for."""
    try:
        array = np.asarray(matrix)
    except (TypeError, ValueError) as error:  # ragged nested lists
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UsageError(f"{what} is not a (C, C) array: {reason}") from None
    if array.dtype.kind not in "biuf" and not (array.dtype == object and _all_real(array)):
        raise UsageError(f"{what} must hold real numbers (counts or probabilities), not {array.dtype} values")
    try:
        matrix = np.asarray(array, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as error:
        raise UsageError(f"{what} is not numeric: {str(error).splitlines()[0] if str(error) else error}") from None
    if matrix.ndim != 2 or matrix.size == 0:
        raise UsageError(f"{what} must be a non-empty 2-D (C, C) array, got shape {matrix.shape}")
    if matrix.shape[0] != matrix.shape[1]:
        raise UsageError(f"{what} must be square (rows = true class, columns = predicted), got {matrix.shape}")
    if not np.all(np.isfinite(matrix)):
        bad = np.argwhere(~np.isfinite(matrix))[0]
        raise UsageError(f"{what} has NaN or infinite entries (first at row {bad[0]}, column {bad[1]})")
    if matrix.min() < 0:
        bad = np.argwhere(matrix < 0)[0]
        raise UsageError(f"{what} has negative entries (first at row {bad[0]}, column {bad[1]}); use counts or probs")
    return matrix


def check_confusion(matrix, what: str = "confusion matrix") -> np.ndarray:
    """The matrix as float64 (C, C) that super-classes can be derived from, or a UsageError saying why not.

    Only ratios of entries matter (rows are normalised, shares are fractions), so a matrix whose entries are too
    large to sum in float64 is scaled down by its largest entry instead of overflowing into NaN.
    """
    matrix = confusion_matrix(matrix, what)
    if matrix.shape[0] < 2:
        raise UsageError(f"{what} has {matrix.shape[0]} class; need at least 2 classes")
    with np.errstate(over="ignore"):
        sums = (matrix.sum(1), matrix.sum(0), matrix.sum())
    if not all(np.isfinite(total).all() for total in sums):
        matrix = matrix / matrix.max()
    off_diagonal = matrix.sum() - np.trace(matrix)
    if off_diagonal <= 0:
        raise UsageError(
            f"{what} has no off-diagonal confusion, so there is nothing to cluster (use random super-classes)"
        )
    return matrix


def _all_real(array: np.ndarray) -> bool:
    """An object array (nested Python lists) of plain real numbers, bools excluded."""
    import numbers

    return all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in array.flat)


def classes_without_images(matrix: np.ndarray) -> list[int]:
    """Classes whose row is all zero: no validation images. They are clustered by their column alone."""
    return [int(c) for c in np.flatnonzero(matrix.sum(1) == 0)]


FORMATS = (".npy", ".csv")


def _format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise UsageError(f"confusion file {path}: unknown format {suffix or '(none)'}; give a .npy or .csv file")
    return suffix


def load_confusion(path: str | os.PathLike) -> tuple[np.ndarray, list[str] | None]:
    """Read a (C, C) matrix of counts or probabilities from .npy or .csv that super-classes can be derived from;
    returns (matrix, class names or None)."""
    matrix, names = read_confusion_file(path)
    return check_confusion(matrix, what=f"confusion matrix in {path}"), names


def read_confusion_file(path: str | os.PathLike) -> tuple[np.ndarray, list[str] | None]:
    """The (C, C) matrix in a .npy or .csv confusion file and its class names (None: none in the file), or one
    UsageError line. A .csv may start with one header row of class names (the predicted classes, in class order)."""
    path = Path(path)
    suffix = _format(path)
    if not path.exists():
        raise UsageError(f"confusion file {path} does not exist")
    if not path.is_file():
        raise UsageError(f"confusion file {path} is not a regular file; give a .npy or .csv file")
    names = None
    try:
        if suffix == ".npy":
            matrix = _read_npy(path)
        else:
            matrix, names = _read_csv(path)
    except UsageError:
        raise
    except (OSError, ValueError, EOFError, UnicodeDecodeError, csv.Error) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UsageError(f"cannot read confusion file {path}: {message}") from None
    matrix = confusion_matrix(matrix, what=f"confusion matrix in {path}")
    if names is not None and len(names) != matrix.shape[0]:
        raise UsageError(f"{path}: header has {len(names)} class names for {matrix.shape[0]} classes")
    return matrix, names


def _read_npy(path: Path) -> np.ndarray:
    """The array in an .npy file, its header read first (numpy.lib.format): an array larger than memory allows, of
    Python objects, or of another size than the file's bytes after the header is refused before anything is
    allocated."""
    with open(path, "rb") as file:
        version = np.lib.format.read_magic(file)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(file)
        offset = file.tell()
    if dtype.hasobject:
        raise UsageError(f"confusion file {path} holds Python objects, not numbers")
    need = math.prod(shape) * dtype.itemsize
    excess = over_memory_limit(need)
    if excess is not None:
        raise UsageError(
            f"confusion file {path}: its header promises a {shape} array of {excess}; a damaged file, or not a "
            "confusion matrix"
        )
    held = path.stat().st_size - offset
    if held != need:
        fault = "fewer bytes than its header promises: truncated" if held < need else "bytes after its array"
        raise UsageError(f"confusion file {path} holds {fault}; a damaged file, or not a .npy file")
    return np.load(path, allow_pickle=False)


def save_confusion(path: str | os.PathLike, matrix: np.ndarray, class_names: list[str]) -> None:
    """Write `matrix` as `path`'s format says, atomically: .npy (the matrix alone), or .csv with a header row of
    `class_names` that load_confusion reads back."""
    path = Path(path)
    with atomic_path(path) as tmp:
        if _format(path) == ".npy":
            with open(tmp, "wb") as file:  # np.save on a path would append ".npy" to the temporary name
                np.save(file, matrix)
            return
        with open(tmp, "w", newline="", encoding="utf-8") as file:
            writer = csv.writer(file)
            writer.writerow(class_names)
            writer.writerows(matrix.tolist())


def check_confusion_output(path: str | os.PathLike, flag: str) -> None:
    """Before the work: `path` names a format save_confusion writes, and replaces nothing but a confusion file."""
    _format(Path(path))
    check_replaceable(path, read=read_confusion_file, kind="confusion file", flag=flag)


def _read_csv(path: Path) -> tuple[np.ndarray, list[str] | None]:
    """The csv module's reading (RFC 4180: quoted names may hold commas, quotes and spaces, kept as written); blank
    lines skipped; the first row is the header of class names when it is not all numbers, or when the rows are one
    more than the columns (names that are numbers: digits-pairs' "00" to "99")."""
    text = read_foreign_text(path, limit=memory_limit() // 8, what="confusion file")  # at most 8x in Python's rows
    # a byte-order mark (Excel's "CSV UTF-8") is no name's; newline="": the csv module's own line endings
    rows_read = csv.reader(io.StringIO(text.removeprefix("\ufeff"), newline=""))
    lines = [row for row in rows_read if any(cell.strip() for cell in row)]
    if not lines:
        raise UsageError(f"confusion file {path} is empty")
    names = None
    if not all(_is_number(cell) for cell in lines[0]) or len(lines) == len(lines[0]) + 1:
        names, lines = lines[0], lines[1:]
    rows = [[cell.strip() for cell in line] for line in lines]
    if any(len(row) != len(rows[0]) for row in rows):
        raise UsageError(f"confusion file {path}: rows have different numbers of columns")
    bad = next((cell for row in rows for cell in row if not _is_number(cell)), None)
    if bad is not None:
        separated = ", and a .csv separates its values with commas" if any(mark in bad for mark in ";\t ") else ""
        raise UsageError(f"confusion file {path}: {bad!r} is not a number{separated}")
    return np.array(rows, dtype=np.float64).reshape(len(rows), -1), names


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
