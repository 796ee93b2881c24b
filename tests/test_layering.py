"""The package's layering, read from the source: each stage imports only the stages below it, outside the entry
points, and no two files import each other (directly or round a longer cycle)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import networkx as nx

REPOSITORY = Path(__file__).resolve().parent.parent
# Lowest first: the ground floor (the package's own modules, models/, utils/, formats/, importers/), then the stages in
# the order data flows through them.
LAYERS = ["mobile_moe", "data", "training", "super_class", "library", "export", "device_bench", "evidence", "app"]


def module_name(path: Path) -> str:
    parts = path.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS[1:] else 0


def is_entry_point(path: Path) -> bool:
    """A command's own module composes the stages it runs: `mobile-moe X` (cli.py, *_cli.py, `python -m mobile_moe`),
    the demo's steps, and mobile_moe/app/ (the dispatch and the demo, above every stage)."""
    command = path.name in ("cli.py", "demo.py", "__main__.py") or path.name.endswith("_cli.py")
    return command or path.parts[:2] == ("mobile_moe", "app")


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
    names = subprocess.run(["git", "ls-files", "mobile_moe/*.py"], cwd=REPOSITORY, capture_output=True, text=True)
    return {module_name(Path(name)): REPOSITORY / name for name in names.stdout.split()}


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


def test_a_command_imports_higher_stages_only_when_it_runs():
    """A stage's command modules (cli.py, *_cli.py, demo.py) import the stages above their own inside functions, so
    importing a lower stage, its commands included, never loads a higher one (super_class's commands never load
    training's modules, `--help` starts at once). `python -m mobile_moe` is the dispatch itself."""
    files = package_files()
    eager = [
        f"{module} imports {target} at module level"
        for module, path in files.items()
        if is_entry_point(path.relative_to(REPOSITORY)) and path.name != "__main__.py"
        and layer(module) < LAYERS.index("app")
        for target, at_module_level in our_imports(path, set(files))
        if at_module_level and layer(target) > layer(module)
    ]
    assert eager == []


def test_no_import_cycle_between_files():
    files = package_files()
    graph = nx.DiGraph()
    for module, path in files.items():
        for target, _ in our_imports(path, set(files)):  # a function-level import is a dependency too
            if target != module and not target.startswith(f"{module}."):
                graph.add_edge(module, target)
    assert list(nx.simple_cycles(graph)) == []
