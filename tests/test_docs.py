"""The project's own documentation: every document the code cites is in the project, and the manifest's JSON Schema
(docs/manifest.schema.json) is the one the pydantic model generates."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

import pytest
from faults import _delete, _set

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


def test_the_schema_has_a_rule_for_every_layout_and_routing():
    from mobile_moe.export.manifest_schema import LAYOUT_RULES, LAYOUTS, LAYOUTS_OF_ROUTING

    schema = json_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema" and set(LAYOUT_RULES) == set(LAYOUTS)
    assert len(schema["allOf"]) == len(LAYOUTS) + len(LAYOUTS_OF_ROUTING)


def changed(manifest: dict, mutation) -> dict:
    """A copy of `manifest` with one of tests/faults.py's mutations applied."""
    return json.loads(mutation(copy.deepcopy(manifest)))


REFUSED_BY_BOTH = {  # what a phone app's JSON Schema validator refuses, as validate_manifest does
    "an expert-paths bundle choosing 2 experts": _set("top_k", 2),
    "an expert-paths bundle without its experts": _delete("composition.experts"),
    "per-token routing in an expert-paths layout": _set("routing", "token"),
    "no experts at all": _set("num_experts", 0),
}


@pytest.mark.parametrize("change", list(REFUSED_BY_BOTH))
def test_a_phone_apps_schema_validator_refuses_what_our_reader_refuses(bundle, change):
    """The committed schema, read by the `jsonschema` library as a phone app's reader would: every real manifest
    passes; each change is refused by it and by validate_manifest alike."""
    import jsonschema

    from mobile_moe.export.manifest_schema import validate_manifest

    validator = jsonschema.Draft202012Validator(json.loads((REPOSITORY / "docs" / "manifest.schema.json").read_text()))
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["composition"]["layout"] == "expert-paths" and not list(validator.iter_errors(manifest))
    refused = changed(manifest, REFUSED_BY_BOTH[change])
    assert list(validator.iter_errors(refused))
    with pytest.raises(ValueError):
        validate_manifest(refused)


def test_a_dense_manifest_passes_and_a_dense_bundle_choosing_experts_is_refused(tmp_path):
    import jsonschema
    from conftest import tiny_model

    from mobile_moe.export.bundle import export_bundle

    validator = jsonschema.Draft202012Validator(json_schema())
    manifest = export_bundle(tiny_model("vit").eval(), tmp_path / "dense", "onnx").to_json()
    assert not list(validator.iter_errors(manifest))
    assert list(validator.iter_errors(changed(manifest, _set("top_k", 1))))


def test_the_native_runners_schema_header_is_the_generated_one():
    from mobile_moe.export.manifest_schema import CPP_HEADER, cpp_header

    regenerate = f"python -m mobile_moe.export.manifest_schema --cpp-header > {CPP_HEADER}"
    assert (REPOSITORY / CPP_HEADER).read_text() == cpp_header(), f"the schema changed: {regenerate}"


def test_the_native_runners_flatbuffer_header_is_the_generated_one():
    from mobile_moe.export.flatbuffer_files import CPP_HEADER, cpp_header

    regenerate = f"python -m mobile_moe.export.flatbuffer_files --cpp-header > {CPP_HEADER}"
    assert (REPOSITORY / CPP_HEADER).read_text() == cpp_header(), f"flatbuffer_files.py changed: {regenerate}"


def test_no_manifest_word_is_spelled_in_cpp_outside_the_parser():
    """Layouts, kinds and roles reach the library as manifest_schema.h's enums; only the parser reads their words."""
    from mobile_moe.export.manifest_schema import KIND_OF_LAYOUT, LAYOUTS, ROLES

    words = "|".join(re.escape(word) for word in {*LAYOUTS, *KIND_OF_LAYOUT.values(), *ROLES})
    compared = re.compile(rf'[=!]=\s*"({words})"|"({words})"\s*[=!]=')
    native = REPOSITORY / "libmobile_moe"
    for path in [*native.rglob("*.cpp"), *native.rglob("*.h")]:
        if path.name not in ("bundle_manifest.cpp", "manifest_schema.h"):
            found = [match.group(0) for match in compared.finditer(path.read_text())]
            assert found == [], f"{path.name} compares manifest words ({found}): use manifest_schema.h's enums"


def test_the_schemas_words_and_bounds_are_spelled_in_cpp_by_the_generated_header_alone():
    """The manifest's format, dtype and resize words, and its bounds, reach libmobile_moe through manifest_schema.h
    (generated from the schema): no other C++ file spells them as a string, and the parser names its bounds (a
    kMax... constant), never a number of its own."""
    from mobile_moe.export.manifest_schema import FORMAT, RESIZE_ORIGINS, TENSOR_DTYPE
    from mobile_moe.preprocess import INTERPOLATIONS, POLICIES

    words = [FORMAT, TENSOR_DTYPE, *POLICIES, *RESIZE_ORIGINS, *INTERPOLATIONS]
    native = REPOSITORY / "libmobile_moe"
    for path in [*native.rglob("*.cpp"), *native.rglob("*.h")]:
        if path.name != "manifest_schema.h":
            text = path.read_text()
            assert [word for word in words if f'"{word}"' in text] == [], f"{path.name} spells the schema's words"
    parser = (native / "src" / "bundle_manifest.cpp").read_text()
    bounds = re.findall(r"as_(?:str|array|int)\([^;]*?, (\d+), (\d+)\)", parser)
    assert [bound for bound in bounds if int(bound[1]) > 1] == [], "bundle_manifest.cpp bounds a value by a number"


def test_the_manifests_routings_are_the_configs():
    """A model's `routing` is the manifest's: per image ones export split (or in one graph), per token ones whole."""
    from mobile_moe.export.manifest_schema import LAYOUTS_OF_ROUTING, SPLIT_LAYOUTS
    from mobile_moe.models.config import PER_IMAGE_ROUTINGS, PER_TOKEN_ROUTINGS
    from mobile_moe.models.registry import MODELS

    assert set(LAYOUTS_OF_ROUTING) == {"none", *PER_IMAGE_ROUTINGS, *PER_TOKEN_ROUTINGS}
    assert {config.routing for config in MODELS.values()} <= set(LAYOUTS_OF_ROUTING)
    assert all(set(LAYOUTS_OF_ROUTING[r]) & set(SPLIT_LAYOUTS) for r in PER_IMAGE_ROUTINGS)
    assert all(LAYOUTS_OF_ROUTING[r] == ("whole",) for r in PER_TOKEN_ROUTINGS)
