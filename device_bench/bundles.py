"""What the benchmark needs to know about a bundle before running it: its manifest, checked before anything runs.

Loading and running graphs is export's runtime's job (export/runtime.py) or a runner's; this reads manifest.json
through export's schema and checks every graph file's sha256 against it, so a bad or tampered bundle is one clear
line here, before it reaches any runtime on the host or is pushed to a phone.
"""

from __future__ import annotations

from pathlib import Path

from mobile_moe.export import manifest as export_manifest

ROLES_OF_KIND = {"router": "split", "dense": "dense", "monolithic": "monolithic", "whole": "whole"}


def read_manifest(bundle: str | Path) -> dict:
    """export's validated manifest (the schema, no path leaving the bundle), after checking every graph file the
    manifest names against its size and sha256."""
    manifest = export_manifest.read_manifest(bundle)
    export_manifest.verify_graph_files(bundle, manifest)
    return manifest


def bundle_kind(manifest: dict) -> str:
    """ "split" (router + experts), "dense", "monolithic" (a per-image MoE in one graph) or "whole" (a per-token MoE,
    which exports only as one graph)."""
    for graph in manifest["graphs"]:
        if graph["role"] in ROLES_OF_KIND:
            return ROLES_OF_KIND[graph["role"]]
    return "split" if "composition" in manifest else "unknown"
