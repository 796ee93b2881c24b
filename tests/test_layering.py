"""The package's layering, read from the source: each stage imports only the stages below it, outside the entry
points, and no two files import each other (directly or round a longer cycle)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import networkx as nx

REPOSITORY = Path(__file__).resolve().parent.parent
# Lowest first: the models and costs, then the stages in the order data flows through them.
LAYERS = ["mobile_moe", "super_class", "training", "export", "device_bench", "evidence", "app"]
FOLDER_OF_PACKAGE = {"mobile_moe": "mobile_moe", **{name: name for name in LAYERS[1:]}}


def module_name(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    if parts[0] != "mobile_moe":
        parts.insert(0, "mobile_moe")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS[1:] else 0


def is_entry_point(path: Path) -> bool:
    """A command's own module composes the stages it runs: `mobile-moe X` (cli.py, *_cli.py, `python -m mobile_moe`),
    the demo's steps, and app/ (the dispatch and the demo, above every stage)."""
    return path.name in ("cli.py", "demo.py", "__main__.py") or path.name.endswith("_cli.py") or path.parts[0] == "app"


def our_imports(path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(module imported, at module level) for each import of our own package in `path`."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mobile_moe"):
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            targets = [name if name in known else node.module for name in names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names if alias.name.startswith("mobile_moe")]
        else:
            continue
        found += [(target, id(node) in top) for target in targets if target in known]
    return found


def package_files() -> dict[str, Path]:
    names = subprocess.run(["git", "ls-files", "*.py"], cwd=REPOSITORY, capture_output=True, text=True).stdout
    folders = set(FOLDER_OF_PACKAGE.values())
    return {module_name(Path(name)): REPOSITORY / name for name in names.split() if Path(name).parts[0] in folders}


def test_no_stage_imports_a_higher_one_outside_the_entry_points():
    files = package_files()
    upward = [
        f"{module} imports {target}"
        for module, path in files.items()
        if not is_entry_point(path.relative_to(REPOSITORY))
        for target, _ in our_imports(path, set(files))
        if layer(target) > layer(module)
    ]
    assert upward == []


def test_no_import_cycle_between_files():
    files = package_files()
    graph = nx.DiGraph()
    for module, path in files.items():
        for target, _ in our_imports(path, set(files)):  # a function-level import is a dependency too
            if target != module and not target.startswith(f"{module}."):
                graph.add_edge(module, target)
    assert list(nx.simple_cycles(graph)) == []
