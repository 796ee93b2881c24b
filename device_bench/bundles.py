"""What the benchmark needs to know about a bundle before running it: its manifest, checked enough to fail early.

Loading and running graphs is export's runtime's job (export/runtime.py) or a runner's; this only reads
manifest.json and checks that the graphs it names are present, so bad input is one clear line instead of a failure
deep inside a runner on a phone.
"""

from __future__ import annotations

from pathlib import Path

from export import manifest as export_manifest
from mobile_moe.errors import UsageError

ROLES_OF_KIND = {"router": "split", "dense": "dense", "monolithic": "monolithic"}


def read_manifest(bundle: str | Path) -> dict:
    """export's validated manifest (format, version, keys, no path leaving the bundle), plus the check a benchmark
    needs before it pushes anything to a phone: every graph file the manifest names is present."""
    manifest = export_manifest.read_manifest(bundle)
    for graph in manifest["graphs"]:
        if not export_manifest.resolve_graph_file(bundle, graph).exists():
            raise UsageError(
                f"bundle {bundle}: graph file {graph['file']!r} named in the manifest is missing; re-export"
            )
    return manifest


def bundle_kind(manifest: dict) -> str:
    """ "split" (router + experts), "dense" or "monolithic"."""
    for graph in manifest["graphs"]:
        if graph["role"] in ROLES_OF_KIND:
            return ROLES_OF_KIND[graph["role"]]
    return "split" if "composition" in manifest else "unknown"


def graph_bytes(manifest: dict) -> dict[str, int]:
    return {graph["name"]: int(graph["bytes"]) for graph in manifest["graphs"]}
