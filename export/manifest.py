"""The bundle manifest (DESIGN.md): writing it, reading it back with validation, and resolving graph files safely.

A bundle is trusted only as far as its manifest: every graph file is resolved inside the bundle directory (a path
that leaves it is refused) and its sha256 is compared with the manifest before any runtime parses it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from export.artifact import file_bytes, file_digest
from mobile_moe.errors import UsageError

MANIFEST = "manifest.json"
FORMAT = "mobile-moe-bundle"
VERSION = 1
BACKENDS = ("executorch", "onnx", "coreml")
REQUIRED = ("format", "version", "backend", "model", "num_experts", "top_k", "input", "class_names", "graphs")
GRAPH_KEYS = ("name", "role", "expert", "file", "sha256", "bytes", "params", "inputs", "outputs")


def graph_entry(spec, path: Path, bundle_dir: Path, details: dict[str, Any]) -> dict[str, Any]:
    """One `graphs` entry for GraphSpec `spec` written at `path` inside `bundle_dir`."""
    entry = {
        "name": spec.name,
        "role": spec.role,
        "expert": spec.expert,
        "file": path.relative_to(bundle_dir).as_posix(),
        "sha256": file_digest(path),
        "bytes": file_bytes(path),
        "params": spec.params,
        "inputs": [tensor.to_dict() for tensor in spec.inputs],
        "outputs": [tensor.to_dict() for tensor in spec.outputs],
        "backend_details": details,
    }
    if spec.block is not None:
        entry["block"] = spec.block
    return entry


def write_manifest(bundle_dir: Path, manifest: dict[str, Any]) -> None:
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(bundle_dir: str | os.PathLike) -> dict[str, Any]:
    """The validated manifest of the bundle at `bundle_dir` (UsageError saying what is wrong otherwise)."""
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST
    if not path.is_file():
        raise UsageError(
            f"{bundle_dir} is not a bundle (no {MANIFEST}); pass a directory written by `mobile-moe export`"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read {path}: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UsageError(f"{path} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise UsageError(f"{path}: bundle version {manifest.get('version')!r} is not supported (expected {VERSION})")
    missing = [key for key in REQUIRED if key not in manifest]
    if missing:
        raise UsageError(f"{path} lacks {', '.join(missing)}; re-export the bundle")
    if manifest["backend"] not in BACKENDS:
        raise UsageError(f"{path}: unknown backend {manifest['backend']!r} (expected one of {', '.join(BACKENDS)})")
    for graph in manifest["graphs"]:
        absent = [key for key in GRAPH_KEYS if key not in graph]
        if absent:
            raise UsageError(f"{path}: graph {graph.get('name')!r} lacks {', '.join(absent)}; re-export the bundle")
        resolve_graph_file(bundle_dir, graph)  # refuse escaping paths at open, before anything is loaded
    return manifest


def resolve_graph_file(bundle_dir: str | os.PathLike, graph: dict[str, Any]) -> Path:
    """The graph's file inside the bundle; a path that leaves the bundle (.., absolute, symlink out) is refused."""
    root = Path(bundle_dir).resolve()
    relative = graph["file"]
    if not isinstance(relative, str) or not relative or Path(relative).is_absolute():
        raise UsageError(f"graph {graph['name']!r}: file {relative!r} must be a path relative to the bundle")
    path = (root / relative).resolve()
    if not path.is_relative_to(root) or path == root:
        raise UsageError(f"graph {graph['name']!r}: file {relative!r} lies outside the bundle {root}; refusing it")
    return path


def verified_graph_file(bundle_dir: str | os.PathLike, graph: dict[str, Any]) -> Path:
    """The graph's file after checking it exists and matches the manifest's size and sha256."""
    path = resolve_graph_file(bundle_dir, graph)
    if not path.exists():
        raise UsageError(f"graph {graph['name']!r}: {path} is missing; re-export the bundle")
    if file_bytes(path) != graph["bytes"] or file_digest(path) != graph["sha256"]:
        raise UsageError(
            f"graph {graph['name']!r}: {path} does not match the sha256 in the manifest (tampered with or truncated); "
            "re-export the bundle"
        )
    return path
