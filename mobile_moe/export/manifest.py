"""The bundle manifest on disk (docs/formats.md): writing it, reading it back as the typed `Manifest` of
mobile_moe/export/manifest_schema.py (the one model every consumer reads), and resolving graph files safely.

A bundle is trusted only as far as its manifest: every graph file is resolved inside the bundle directory (a path
that leaves it is refused) and its sha256 is compared with the manifest before any runtime parses it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mobile_moe.errors import UsageError
from mobile_moe.export.artifact import file_bytes, file_digest
from mobile_moe.export.flatbuffer_files import check_graph_file
from mobile_moe.export.manifest_schema import (  # noqa: F401 (BACKENDS: the CLI's)
    BACKENDS,
    FORMAT,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    VERSION,
    GraphEntry,
    GraphFile,
    Manifest,
    validate_manifest,
)
from mobile_moe.formats.versions import check_version
from mobile_moe.utils import jsonio
from mobile_moe.utils.foreign_files import read_foreign


def planned_entry(spec, file: str) -> dict[str, Any]:
    """The `graphs` entry GraphSpec `spec` will have as `file`, before it is written (no size or sha256 yet): enough
    for the schema to check the whole manifest before any graph is exported."""
    entry = {
        "name": spec.name,
        "role": spec.role,
        "expert": spec.expert,
        "file": file,
        "sha256": "0" * 64,
        "bytes": 0,
        "params": spec.params,
        "inputs": [tensor.model_dump() for tensor in spec.inputs],
        "outputs": [tensor.model_dump() for tensor in spec.outputs],
        "backend_details": {},
    }
    if spec.block is not None:
        entry["block"] = spec.block
    return entry


def graph_entry(spec, artifact, bundle_dir: Path) -> dict[str, Any]:
    """One `graphs` entry for GraphSpec `spec` exported as `artifact` (export.artifact.Artifact) inside `bundle_dir`."""
    entry = planned_entry(spec, artifact.path.relative_to(bundle_dir).as_posix())
    entry.update(sha256=file_digest(artifact.path), bytes=file_bytes(artifact.path), backend_details=artifact.details)
    if artifact.weights is not None:
        entry["weights"] = {
            "file": artifact.weights.relative_to(bundle_dir).as_posix(),
            "sha256": file_digest(artifact.weights),
            "bytes": file_bytes(artifact.weights),
        }
    return entry


def write_manifest(bundle_dir: Path, manifest: Manifest) -> None:
    (bundle_dir / MANIFEST).write_text(jsonio.dumps(manifest.to_json(), indent=2) + "\n")  # a NaN parity error: null


def _parse(path: Path) -> Any:
    """manifest.json parsed as JSON, bounded; UsageError saying why it cannot be (the one place that reads it)."""
    data = read_foreign(path, limit=MAX_MANIFEST_BYTES, what="manifest")  # not a FIFO, a device or a giant
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        # ValueError: bad JSON, or an integer of thousands of digits; RecursionError: absurdly deep nesting
        reason = "nested too deeply" if isinstance(error, RecursionError) else error
        raise UsageError(f"cannot read {path}: {reason}; re-export the bundle") from None


def read_manifest(bundle_dir: str | os.PathLike, *, verify_files: bool = False) -> Manifest:
    """The validated manifest of the bundle at `bundle_dir` (UsageError saying what is wrong otherwise).

    Validation is the schema's (mobile_moe/export/manifest_schema.py): types, ranges and the rules tying fields
    together; then every graph file is resolved inside the bundle (a path that leaves it is refused). Graph files
    (sha256 and structure) are checked by `verified_graph_files` when a graph is loaded (the lazy Python runtime), or
    here with `verify_files=True`: before a bundle is handed to what we do not drive graph by graph (bench, a runner, a
    phone).
    """
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST
    if not path.is_file():  # also refuses FIFOs and devices, which would block or never end
        from mobile_moe.training.run_dir import CONFIG

        if (bundle_dir / CONFIG).is_file():
            raise UsageError(
                f"{bundle_dir} is a training run, not a bundle; export it first: `mobile-moe export {bundle_dir} "
                "--format executorch --out BUNDLE`, then pass BUNDLE"
            )
        raise UsageError(
            f"{bundle_dir} is not a mobile-moe bundle (no {MANIFEST}); pass a directory written by `mobile-moe export`"
        )
    manifest = _parse(path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UsageError(f"{path} is not a {FORMAT} manifest")
    check_version(manifest, VERSION, where=str(path), what="a bundle manifest",
                  fix="export the bundle again with `mobile-moe export`")  # fmt: skip
    try:
        manifest = validate_manifest(manifest)
    except ValueError as error:
        raise UsageError(f"{path}: {error}; re-export the bundle") from None
    for graph in manifest.graphs:
        for file in graph.files():
            # At open, before anything is loaded: a path leaving the bundle, or a file that is not there (a bundle
            # copied in part), is refused now rather than when an image first picks that expert.
            if not resolve_graph_file(bundle_dir, graph, file).exists():
                raise UsageError(f"graph {graph.name!r}: {file.file} is missing; re-export the bundle")
    if verify_files:
        verify_graph_files(bundle_dir, manifest)
    return manifest


def is_bundle(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory whose manifest.json says it is a mobile-moe bundle (its format field)."""
    manifest = Path(path) / MANIFEST
    try:
        data = _parse(manifest) if manifest.is_file() else None
    except UsageError:
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def bundle_files(path: str | os.PathLike) -> set[str] | None:
    """The names directly inside the bundle directory `path` that its manifest accounts for (what export wrote);
    None when `path` is not a bundle (atomic.check_output_folder's `ours`)."""
    path = Path(path)
    if not is_bundle(path):
        return None
    ours = {MANIFEST}
    try:
        manifest = _parse(path / MANIFEST)
    except UsageError:
        manifest = None
    graphs = manifest.get("graphs") if isinstance(manifest, dict) else None
    for graph in graphs if isinstance(graphs, list) else []:
        weights = graph.get("weights") if isinstance(graph, dict) else None
        for entry in (graph, weights if isinstance(weights, dict) else None):
            file = entry.get("file") if isinstance(entry, dict) else None
            if isinstance(file, str) and len(Path(file).parts) == 1:  # export writes top-level files and packages
                ours.add(file)
    return ours


def resolve_graph_file(bundle_dir: str | os.PathLike, graph: GraphEntry, file: GraphFile | None = None) -> Path:
    """The graph's program (or `file`, one of graph.files()) inside the bundle; a path that leaves the bundle
    (.., absolute, symlink out) is refused."""
    root = Path(bundle_dir).resolve()
    relative = (file or graph).file
    if not relative or Path(relative).is_absolute():
        raise UsageError(f"graph {graph.name!r}: file {relative!r} must be a path relative to the bundle")
    path = (root / relative).resolve()
    if not path.is_relative_to(root) or path == root:
        raise UsageError(f"graph {graph.name!r}: file {relative!r} lies outside the bundle {root}; refusing it")
    return path


def verified_graph_files(bundle_dir: str | os.PathLike, graph: GraphEntry) -> list[Path]:
    """The graph's files (graph.files(): its program, then its weights file if any), each checked to exist, match the
    manifest's size and sha256, and (ExecuTorch's files) be safe to hand to ExecuTorch
    (mobile_moe/export/flatbuffer_files.py)."""
    return [_verified(bundle_dir, graph, file) for file in graph.files()]


def _verified(bundle_dir: str | os.PathLike, graph: GraphEntry, file: GraphFile) -> Path:
    path = resolve_graph_file(bundle_dir, graph, file)
    try:  # exists() and reading raise for names too long, unreadable files and the like
        if not path.exists():
            raise UsageError(f"graph {graph.name!r}: {path} is missing; re-export the bundle")
        if not (path.is_file() or path.is_dir()):
            raise UsageError(f"graph {graph.name!r}: {path} is not a regular file; re-export the bundle")
        if file_bytes(path) != file.bytes or file_digest(path) != file.sha256:
            raise UsageError(
                f"graph {graph.name!r}: {path} does not match the sha256 in the manifest (tampered with or "
                "truncated); re-export the bundle"
            )
        # A file re-sealed after tampering matches its sha256: its structure is checked before any runtime reads it.
        check_graph_file(path, external_data=graph.weights is not None)
    except UsageError:  # ours, above: said as it is (a UsageError is a ValueError, which means damage below)
        raise
    except OSError as error:
        raise UsageError(f"graph {graph.name!r}: cannot read {file.file!r}: {error.strerror}") from None
    except ValueError as error:
        raise UsageError(f"graph {graph.name!r}: {file.file} is damaged: {error}; re-export the bundle") from None
    return path


def bundle_identity(bundle_dir: str | os.PathLike) -> tuple[int, int] | None:
    """The bundle folder's (device, inode), None if it cannot be read. Export replaces a bundle by renaming a new folder
    over it (mobile_moe/utils/atomic.py), so a changed identity means another command exported over the bundle."""
    try:
        status = os.stat(bundle_dir)
    except OSError:
        return None
    return status.st_dev, status.st_ino


@contextlib.contextmanager
def same_bundle(bundle_dir: str | os.PathLike, identity: tuple[int, int] | None) -> Iterator[None]:
    """Around a read of the bundle's files after its manifest was read (a lazily loaded expert, a bench round): the
    folder at `bundle_dir` must still be the one whose `identity` was taken before that manifest was read. If not,
    its files belong to another bundle, exported over this one, which is neither damaged nor the one being read: one
    line says so, whether the read failed (a refusal the swap caused) or not (a swap between checking and loading
    mixes two bundles)."""
    try:
        yield
    except UsageError:
        _check_not_replaced(bundle_dir, identity)
        raise
    _check_not_replaced(bundle_dir, identity)


def _check_not_replaced(bundle_dir: str | os.PathLike, identity: tuple[int, int] | None) -> None:
    if bundle_identity(bundle_dir) != identity:
        raise UsageError(
            f"{bundle_dir} was replaced (another command exported over it) while this command was reading it; run "
            "this command again"
        )


def verify_graph_files(bundle_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Check every graph file of the bundle against the manifest: before a bundle is handed to a runtime we do not
    drive graph by graph (the native runner, a phone). A program that several graphs share (an expert family's) is
    read and hashed once, not once per expert; every distinct claim (file, size, sha256) is checked."""
    checked: set[GraphFile] = set()
    for graph in manifest.graphs:
        for file in graph.files():
            if file not in checked:
                _verified(bundle_dir, graph, file)
                checked.add(file)
