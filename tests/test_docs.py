"""The project's own documentation: every document the code cites is in the project, and the manifest's JSON Schema
(docs/manifest.schema.json) is the one the pydantic model generates."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from mobile_moe.export.manifest_schema import json_schema

REPOSITORY = Path(__file__).resolve().parent.parent


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPOSITORY, capture_output=True, text=True, check=True).stdout
    suffixes = {".py", ".md", ".cpp", ".h", ".txt", ".toml", ".sh", ".cmake", ""}
    return [REPOSITORY / name for name in names.splitlines() if Path(name).suffix in suffixes]


def test_every_cited_document_is_in_the_project():
    """Formats are documented in docs/; the team's design notes outside the repository are never a reference."""
    text = {path: path.read_text() for path in tracked_text_files() if path.is_file() and path.name != "test_docs.py"}
    outside = sorted(str(path.relative_to(REPOSITORY)) for path, body in text.items() if "DESIGN.md" in body)
    cited = {name for body in text.values() for name in re.findall(r"\bdocs/[\w./-]*\w", body)}
    assert outside == [] and cited and sorted(name for name in cited if not (REPOSITORY / name).exists()) == []


def test_the_committed_json_schema_is_the_generated_one():
    committed = json.loads((REPOSITORY / "docs" / "manifest.schema.json").read_text())
    regenerate = "python -m mobile_moe.export.manifest_schema > docs/manifest.schema.json"
    assert committed == json_schema(), f"the schema changed: {regenerate}"
