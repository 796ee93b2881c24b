"""Fault injection shared by the fault-injection tests: manifest mutations and byte flips in graph files.

A mutation takes a bundle's manifest (a dict, free to change) and returns the text to write as manifest.json. Every
one of them makes the bundle invalid: each consumer (predict, the Python runtime, bench, the native runner) must
refuse it with exit status 2 and one short line, never crash, hang or run it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from mobile_moe.export import flatbuffer_files as files
from mobile_moe.export.artifact import file_bytes, file_digest

Mutation = Callable[[dict], str]


def _set(path: str, value) -> Mutation:
    """Set the value at a dotted path ("input.shape.2", "graphs.1.expert") and write the manifest as JSON."""

    def mutate(manifest: dict) -> str:
        *parents, last = path.split(".")
        node = manifest
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return json.dumps(manifest)

    return mutate


def _delete(path: str) -> Mutation:
    def mutate(manifest: dict) -> str:
        *parents, last = path.split(".")
        node = manifest
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        del node[last]
        return json.dumps(manifest)

    return mutate


def _raw(replace: Callable[[str], str]) -> Mutation:
    """A textual edit of the JSON (for numbers json.dumps would not write, such as 1e300 integers or NaN)."""
    return lambda manifest: replace(json.dumps(manifest))


def _raw_number(key: str, text: str) -> Mutation:
    """Write `text` as the value of the top-level `key` (the old value stays behind, under "was")."""
    return _raw(lambda doc: doc.replace(f'"{key}": ', f'"{key}": {text}, "was": ', 1))


def first_mean_written_as(text: str) -> Callable[[str], str]:
    """A textual edit of the manifest's JSON: the input's first mean written as `text`, whatever its value was."""
    return lambda doc: re.sub(r'"mean": \[[^,\]]*,', f'"mean": [{text},', doc, count=1)


def _num_experts_raw(text: str) -> Mutation:
    return _raw_number("num_experts", text)


def _shrink_class_names(manifest: dict) -> str:
    manifest["class_names"] = manifest["class_names"][:2]
    return json.dumps(manifest)


def _swap_graph_files(manifest: dict) -> str:
    graphs = manifest["graphs"]
    graphs[0]["file"], graphs[1]["file"] = graphs[1]["file"], graphs[0]["file"]
    return json.dumps(manifest)


def _duplicate_graph(manifest: dict) -> str:
    manifest["graphs"].append(copy.deepcopy(manifest["graphs"][0]))
    return json.dumps(manifest)


def _expert_index(value) -> Mutation:
    def mutate(manifest: dict) -> str:
        next(g for g in manifest["graphs"] if g["expert"] is not None)["expert"] = value
        return json.dumps(manifest)

    return mutate


def _params_active_beyond_graphs(manifest: dict) -> str:
    """More active parameters than every graph of the bundle holds together: more than any image can touch."""
    manifest["params_active_max"] = sum(graph["params"] for graph in manifest["graphs"]) + 1
    return json.dumps(manifest)


def _first_expert_input_shape(shape) -> Mutation:
    def mutate(manifest: dict) -> str:
        next(g for g in manifest["graphs"] if g["expert"] is not None)["inputs"][0]["shape"] = shape
        return json.dumps(manifest)

    return mutate


def _experts(manifest: dict) -> list[dict]:
    """Every expert graph: a weights mutation reaches them all, so predict meets it whichever expert it loads."""
    graphs = [g for g in manifest["graphs"] if g["expert"] is not None]
    assert all("weights" in g for g in graphs), "the fault bundle's experts share one program, each own weights"
    return graphs


def _expert_weights(key: str, value) -> Mutation:
    def mutate(manifest: dict) -> str:
        for graph in _experts(manifest):
            graph["weights"][key] = value
        return json.dumps(manifest)

    return mutate


def _set_expert_weights(value) -> Mutation:
    def mutate(manifest: dict) -> str:
        for graph in _experts(manifest):
            graph["weights"] = value
        return json.dumps(manifest)

    return mutate


def _weights_are_the_program(manifest: dict) -> str:
    for graph in _experts(manifest):
        graph["weights"] = {key: graph[key] for key in ("file", "sha256", "bytes")}
    return json.dumps(manifest)


def _crop(**sizes) -> dict:
    return {"policy": "resize-center-crop", **sizes}


# name -> mutation; every split (expert-paths, k = 1) bundle is refused after any of them.
MANIFEST_MUTATIONS: dict[str, Mutation] = {
    "num_experts_1": _set("num_experts", 1),  # the router still emits E probabilities
    "num_experts_huge": _num_experts_raw("1e300"),
    "num_experts_negative": _set("num_experts", -3),
    "num_experts_bool": _set("num_experts", True),
    "num_experts_string": _set("num_experts", "4"),
    "num_experts_5000_digits": _num_experts_raw("9" * 5000),
    "top_k_0": _set("top_k", 0),
    "top_k_fraction": _set("top_k", 1.5),
    "top_k_50": _set("top_k", 50),
    "top_k_2_expert_paths": _set("top_k", 2),
    "input_shape_smaller": _set("input.shape", [1, 3, 16, 16]),
    "input_shape_zero": _set("input.shape", [1, 3, 0, 0]),
    "input_shape_huge": _raw(lambda doc: doc.replace('"shape": [1, 3, 32, 32]', '"shape": [1, 3, 1e300, 1e300]', 1)),
    "input_shape_3d": _set("input.shape", [1, 3, 32]),
    "input_graph_shape_differs": _first_expert_input_shape([1, 4, 32]),
    "std_zero": _set("input.std", [0.0, 1.0, 1.0]),
    "mean_nan": _raw(first_mean_written_as("NaN")),
    "mean_short": _set("input.mean", [0.0]),
    "class_names_short": _shrink_class_names,
    "class_names_not_strings": _set("class_names", list(range(7))),
    # a NUL would cut the name where mm_class_name hands it to C; a name twice makes two classes one
    "class_name_nul": _set("class_names.0", "cat\u0000dog"),
    "class_names_twice": _set("class_names.1", "0"),
    "layout_missing": _delete("composition.layout"),
    "layout_unknown": _set("composition.layout", "sideways"),
    "composition_missing": _delete("composition"),
    "composition_names_absent_graph": _set("composition.experts.0", "expert_99"),
    # early routing's trunk tail: a graph of its own role, tokens -> tokens
    "trunk_tail_names_absent_graph": _set("composition.trunk_tail", "tail_99"),
    "trunk_tail_names_the_router": _set("composition.trunk_tail", "router"),
    "trunk_tail_not_a_string": _set("composition.trunk_tail", 3),
    "graphs_not_a_list": _set("graphs", {"router": "router.pte"}),
    "graphs_empty": _set("graphs", []),
    "graph_duplicated": _duplicate_graph,
    "graph_files_swapped": _swap_graph_files,
    "graph_file_escapes": _set("graphs.0.file", "../../etc/passwd"),
    "graph_file_escapes_to_nothing": _set("graphs.0.file", "../no-such-bundle/router.pte"),  # outside, not "missing"
    "graph_file_absolute": _set("graphs.0.file", "/etc/passwd"),
    "graph_role_unknown": _set("graphs.0.role", "oracle"),
    "graph_sha256_not_hex": _set("graphs.0.sha256", "z" * 64),
    "graph_bytes_negative": _set("graphs.0.bytes", -1),
    "expert_index_out_of_range": _expert_index(12),
    "expert_index_negative": _expert_index(-1),
    "format_missing": _delete("format"),
    "version_1": _set("version", 1),  # an older format: refused, exported again
    "version_3": _set("version", 3),
    "version_missing": _delete("version"),
    "backend_unknown": _set("backend", "tflite"),
    "not_an_object": lambda manifest: json.dumps([manifest]),
    "empty_file": lambda manifest: "",
    "truncated": lambda manifest: json.dumps(manifest)[:200],
    "nested_50000_deep": lambda manifest: '{"format": "mobile-moe-bundle", "x": ' + "[" * 50_000 + "]" * 50_000 + "}",
    "not_utf8": lambda manifest: json.dumps(manifest).replace("router", "r\udcffouter", 1),
    # what an image touches: the routing kind and the parameters one image may compute with
    "routing_missing": _delete("routing"),
    "routing_unknown": _set("routing", "psychic"),
    "routing_not_a_string": _set("routing", 3),
    "routing_token_for_expert_paths": _set("routing", "token"),  # a per-token MoE never splits by expert
    "routing_none_for_expert_paths": _set("routing", "none"),
    "params_active_max_missing": _delete("params_active_max"),
    "params_active_max_negative": _set("params_active_max", -1),
    "params_active_max_fraction": _set("params_active_max", 1.5),
    "params_active_max_string": _set("params_active_max", "95535"),
    "params_active_max_huge": _raw_number("params_active_max", "1e300"),
    "params_active_max_beyond_graphs": _params_active_beyond_graphs,
    "layout_whole_for_split": _set("composition.layout", "whole"),
    # the exported run's validation accuracy (bench reports plot it)
    "validation_top1_above_one": _set("validation_top1", 1.5),
    "validation_top1_string": _set("validation_top1", "0.9"),
    # how predict resizes an image file (input.resize): a policy it knows, sizes that fit the input
    "resize_missing": _delete("input.resize"),
    "resize_null": _set("input.resize", None),
    "resize_policy_unknown": _set("input.resize", {"policy": "fisheye"}),
    "resize_not_an_object": _set("input.resize", "stretch"),
    "resize_crop_larger_than_resize": _set("input.resize", _crop(resize_to=30, crop_to=32)),
    "resize_size_zero": _set("input.resize", _crop(resize_to=0, crop_to=32)),
    "resize_size_fraction": _set("input.resize", _crop(resize_to=36.5, crop_to=32)),
    "resize_crop_not_the_input_size": _set("input.resize", _crop(resize_to=37, crop_to=16)),
    "resize_crop_missing": _set("input.resize", {"policy": "resize-center-crop", "resize_to": 37}),
    "resize_unknown_key": _set("input.resize", _crop(resize_to=37, crop_to=32, antialias=False)),
    "resize_interpolation_unknown": _set("input.resize", _crop(resize_to=37, crop_to=32, interpolation="nearest")),
    "resize_origin_unknown": _set("input.resize", {"policy": "stretch", "origin": "guessed"}),
    "resize_origin_data_spec": _set("input.resize", {"policy": "stretch", "origin": "data-spec"}),  # no longer a word
    # an expert's own weights file (experts share one program): inside the bundle, well-formed, not the program
    "weights_file_escapes": _expert_weights("file", "../../etc/passwd"),
    "weights_file_absolute": _expert_weights("file", "/etc/passwd"),
    "weights_file_missing": _expert_weights("file", "expert_99.ptd"),
    "weights_file_is_the_program": _weights_are_the_program,
    "weights_bytes_negative": _expert_weights("bytes", -1),
    "weights_not_an_object": _set_expert_weights("expert_0.ptd"),
    "weights_on_onnx": _set("backend", "onnx"),  # a split bundle with weights files is ExecuTorch's
}


# name -> mutation of what only reports read: what export measured of a quantized bundle itself (bench shows it beside
# the checkpoint's top-1). Python refuses them where it reads the manifest; the native runner reads none of it.
REPORT_MANIFEST_MUTATIONS: dict[str, Mutation] = {
    "quantization_not_an_object": _set("quantization", [1]),
    "quantized_validation_not_an_object": _set("quantization", {"validation": "great"}),
    "quantized_top1_above_one": _set("quantization", {"validation": {
        "images": 8, "fp32_top1": 0.5, "quantized_top1": 1.5, "top1_change": 1.0, "prediction_agreement": 1.0}}),
    "quantized_validation_without_numbers": _set("quantization", {"validation": {"images": 8}}),
}


def _whole_graph(change: Callable[[dict], None]) -> Mutation:
    """Apply `change` to the one graph entry of a whole bundle."""

    def mutate(manifest: dict) -> str:
        change(manifest["graphs"][0])
        return json.dumps(manifest)

    return mutate


def _expert_tokens(change: Callable[[dict], None]) -> Mutation:
    return _whole_graph(lambda graph: change(next(o for o in graph["outputs"] if o["name"] == "expert_tokens")))


def _second_whole_graph(manifest: dict) -> str:
    manifest["graphs"].append(dict(copy.deepcopy(manifest["graphs"][0]), name="whole_again"))
    return json.dumps(manifest)


def _params_active_beyond_whole(manifest: dict) -> str:
    manifest["params_active_max"] = manifest["graphs"][0]["params"] + 1
    return json.dumps(manifest)


# name -> mutation; every whole bundle (a per-token MoE: one graph, images -> logits, expert_tokens (1, G, E)) is
# refused after any of them.
WHOLE_MANIFEST_MUTATIONS: dict[str, Mutation] = {
    "expert_tokens_2d": _expert_tokens(lambda spec: spec.update(shape=spec["shape"][:1] + spec["shape"][2:])),
    "expert_tokens_too_many_experts": _expert_tokens(lambda spec: spec.update(shape=[*spec["shape"][:2], 9])),
    "expert_tokens_batch_2": _expert_tokens(lambda spec: spec.update(shape=[2, *spec["shape"][1:]])),
    "expert_tokens_renamed": _expert_tokens(lambda spec: spec.update(name="router_probs")),
    "expert_tokens_dropped": _whole_graph(lambda graph: graph.update(outputs=graph["outputs"][:1])),
    "second_input": _whole_graph(lambda graph: graph["inputs"].append(dict(graph["inputs"][0], name="again"))),
    "role_monolithic": _set("graphs.0.role", "monolithic"),
    "layout_monolithic": _set("composition.layout", "monolithic"),
    "layout_expert_paths": _set("composition.layout", "expert-paths"),
    "trunk_tail_in_whole": _set("composition.trunk_tail", "whole"),  # only expert-paths has a trunk tail
    "second_graph": _second_whole_graph,
    "num_experts_0": _set("num_experts", 0),
    "num_experts_differs": _set("num_experts", 3),
    "top_k_beyond_experts": _set("top_k", 5),
    "top_k_negative": _set("top_k", -1),
    "routing_image": _set("routing", "image"),
    "routing_unknown": _set("routing", "psychic"),
    "params_active_beyond_graph": _params_active_beyond_whole,
    "params_active_negative": _set("params_active_max", -1),
}


def copy_bundle(bundle: Path, to: Path) -> Path:
    shutil.copytree(bundle, to)
    return to


def write_manifest_text(bundle: Path, text: str) -> None:
    (bundle / "manifest.json").write_bytes(text.encode("utf-8", errors="surrogateescape"))


def mutate_manifest(bundle: Path, name: str, table: dict[str, Mutation] = MANIFEST_MUTATIONS) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    write_manifest_text(bundle, table[name](manifest))


def untrained_run(run: Path, model, super_classes: dict | None = None) -> Path:
    """A run directory as training writes it (config.json + best.pt) for `model`, untrained, on digits."""
    from mobile_moe.data.datasets import data_record, open_data
    from mobile_moe.models.checkpoint import checkpoint_dict, save_checkpoint
    from mobile_moe.training.run_dir import write_config

    write_config(run, {"model": model.config.to_dict(), "data": data_record(open_data("digits", 32)),
                       "super_classes": super_classes, "recipe": {}})  # fmt: skip
    save_checkpoint(checkpoint_dict(model, epoch=1), run / "best.pt")
    return run


def whole_bundle(tmp_path_factory, backend: str) -> Path:
    """A tiny V-MoE (per-token routing, k = 2 of 4 experts, 2 MoE blocks) exported whole for `backend`: once per
    session (conftest.built_once), so every module and worker that asks shares it (an ExecuTorch export takes tens
    of seconds), and with test_export_reference_moes.py, whose vmoe bundle it is. Tests that change it work on a
    copy."""
    from conftest import built_once, tiny_model

    from mobile_moe.export.bundle import export_bundle

    model = tiny_model("vmoe").eval()
    export = lambda out: export_bundle(model, out, backend)  # noqa: E731
    return built_once(tmp_path_factory, f"reference-vmoe-{backend}", export)


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def first_weight_byte(ptd: Path) -> int:
    """The offset of the first byte of a .ptd file's segment data: a tensor's own bytes. A fixed offset can land in
    the FlatTensor header instead (it is a kilobyte long, its segments ordered by their keys, which hash the
    weights: the weights' last bits, and so the layout, differ with ATen's CPU kernels)."""
    header = files.FLAT_TENSOR_HEADER.unpack_from(ptd.read_bytes(), 8)
    return dict(zip(files.FLAT_TENSOR_HEADER_FIELDS, header, strict=True))["segment_base"]


def reseal(bundle: Path) -> None:
    """Record every graph file's (and weights file's) current bytes and sha256 in the manifest: tampering that a
    checksum cannot see."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    for graph in manifest["graphs"]:
        for entry in (graph, graph.get("weights")):
            if entry:
                entry["sha256"] = file_digest(bundle / entry["file"])
                entry["bytes"] = file_bytes(bundle / entry["file"])
    (bundle / "manifest.json").write_text(json.dumps(manifest))


HEADER_BYTES = range(64)  # every file's identifier, extended header and first flatbuffer tables: each byte is swept


def flip_offsets(size: int, count: int, seed: int) -> list[int]:
    """Header offsets that crashed the runner before (0, 48, 52, 60), then `count` seeded random offsets."""
    rng = random.Random(seed)
    return [0, 48, 52, 60, *sorted(rng.randrange(size) for _ in range(count))]


def table_positions(buffer, position: int, schema) -> list[int]:
    """Every table mobile_moe/export/flatbuffer_files.py walks under the one at `position` (itself included), by
    position."""
    found = [position]
    present = files._table(buffer, position, schema, "table")
    for index, (kind, detail) in schema.fields.items():
        if index in present and kind == "table":
            found += table_positions(buffer, buffer.target(present[index], "child"), detail)
        elif index in present and kind == "tables":
            for child in files._vector_of_tables(buffer, present[index]):
                found += table_positions(buffer, child, detail)
    return found


def without_each_entry(data: bytes) -> list[bytes]:
    """An ExecuTorch file (a program, or a weights file by its identifier) with one vtable entry zeroed (that field
    read as absent), for every entry of every table the check walks; a vtable shared by several tables counts once."""
    if data[4:8] == files.FLAT_TENSOR_IDENTIFIER:
        offset, size = files.FLAT_TENSOR_HEADER.unpack_from(data, 8)[2:4]
        end, schema = offset + size, files.FLAT_TENSOR
    else:
        end, schema = files.PROGRAM_HEADER.unpack_from(data, 8)[2], files.PROGRAM
    buffer = files._Buffer(data, end)
    root = buffer.target(0, "root")
    vtables = {table - struct.unpack_from("<i", data, table)[0] for table in table_positions(buffer, root, schema)}
    variants = []
    for vtable in sorted(vtables):
        for slot in range(4, struct.unpack_from("<H", data, vtable)[0], 2):
            if struct.unpack_from("<H", data, vtable + slot)[0]:
                damaged = bytearray(data)
                struct.pack_into("<H", damaged, vtable + slot, 0)
                variants.append(bytes(damaged))
    return variants


# --- processes left behind ------------------------------------------------------------------------------------------

# A parent that starts its argv as a child, prints the child's pid and waits: SIGKILLed, it cannot stop the child.
PARENT = "import subprocess, sys\nchild = subprocess.Popen(sys.argv[1:])\nprint(child.pid, flush=True)\nchild.wait()\n"


def running(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that is gone to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def outlives_its_killed_parent(command: list[str], settle_s: float = 0.5, patience_s: float = 2.0,
                               ready: Path | None = None) -> bool:  # fmt: skip
    """Start `command` under a parent process, SIGKILL the parent once the child is set up (it has created `ready`;
    without one, once it has had `settle_s`: a busy machine can take longer), and say whether the child still runs
    `patience_s` later (it is killed then)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, *command], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(settle_s)
    deadline = time.monotonic() + 120
    while ready is not None and not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline and running(child):
        time.sleep(0.05)
    outlived = running(child)
    if outlived:
        os.kill(child, signal.SIGKILL)
    return outlived


@contextlib.contextmanager
def small_file_system(folder: Path, size: str = "256k") -> Iterator[Path]:
    """A tmpfs of `size` mounted at `folder`, unmounted after: a phone whose storage is (nearly) full. The test skips,
    saying why, where this user may not mount one (not root, or a container without CAP_SYS_ADMIN)."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("a small file system is a tmpfs mounted for the test, which needs root")
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], capture_output=True)
