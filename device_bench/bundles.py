"""What the benchmark needs to know about a bundle before running it: its manifest, checked enough to fail early.

Loading and running graphs is export's runtime's job (export/runtime.py) or a runner's; this only reads
manifest.json and checks that the graphs it names are present, so bad input is one clear line instead of a failure
deep inside a runner on a phone.
"""

from __future__ import annotations

import json
from pathlib import Path

from mobile_moe.errors import UsageError

ROLES_OF_KIND = {"router": "split", "dense": "dense", "monolithic": "monolithic"}


def read_manifest(bundle: str | Path) -> dict:
    bundle = Path(bundle)
    manifest_path = bundle / "manifest.json"
    if not bundle.is_dir():
        raise UsageError(f"bundle {bundle} is not a directory; pass a bundle written by `mobile-moe export`")
    if not manifest_path.is_file():
        raise UsageError(f"bundle {bundle} has no manifest.json; export it with `mobile-moe export`")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as error:
        raise UsageError(f"{manifest_path} is not valid JSON ({error}); re-export the bundle") from error
    if manifest.get("format") != "mobile-moe-bundle" or not manifest.get("graphs"):
        raise UsageError(f"{manifest_path} is not a mobile-moe bundle manifest (format/graphs missing)")
    root = bundle.resolve()
    for graph in manifest["graphs"]:
        path = (root / graph["file"]).resolve()
        if not path.is_relative_to(root):
            raise UsageError(f"bundle {bundle}: graph file {graph['file']!r} leaves the bundle directory; refusing it")
        if not path.exists():
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
