"""What every backend exporter returns, and the file facts (bytes, sha256) the manifest records for it.

All exporters share one signature, `(module, example_inputs, out_path, **options) -> Artifact`, so the bundle builder
treats them alike. A graph file is a plain file (.pte, .onnx) or, for Core ML, a package directory (.mlpackage):
both are hashed and measured through `file_digest` / `file_bytes`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Artifact:
    path: Path
    details: dict[str, Any] = field(default_factory=dict)  # backend facts for the manifest (delegation, precision)
    weights: Path | None = None  # ExecuTorch: the .ptd holding this graph's own weights when `path` is shared


def _files(path: Path) -> list[Path]:
    """The plain files that make up an artifact, in a fixed order (a package directory is walked, sorted)."""
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path]


def file_digest(path: str | Path) -> str:
    """sha256 of a file; for a directory, of every file's relative path and contents in sorted order."""
    path = Path(path)
    digest = hashlib.sha256()
    for file in _files(path):
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with open(file, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def file_bytes(path: str | Path) -> int:
    return sum(file.stat().st_size for file in _files(Path(path)))
