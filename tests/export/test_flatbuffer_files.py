"""mobile_moe/export/flatbuffer_files.py: a .ptd and a .pte are walked as flatbuffers' Verifier would before ExecuTorch
reads them. Damage that would send ExecuTorch's reader out of bounds, or put bytes that are not UTF-8 into its log
lines, is refused with a ValueError naming it."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
from faults import without_each_entry

from mobile_moe.export import flatbuffer_files
from mobile_moe.export.flatbuffer_files import FLAT_TENSOR_HEADER as HEADER
from mobile_moe.export.flatbuffer_files import (
    PROGRAM_HEADER,
    check_flat_tensor,
    check_flat_tensor_file,
    check_graph_file,
    check_program,
)


@pytest.fixture
def ptd(bundle) -> bytes:
    return (bundle / "expert_1.ptd").read_bytes()


def fields(data: bytes) -> dict:
    """Where things are: {"header": (fb offset, fb size, segment base, segment size), "segments": [field positions],
    "named": [field positions], "named_tables": [table positions]} (read with the checker's own walk)."""
    header = HEADER.unpack_from(data, 8)[2:]
    buffer = flatbuffer_files._Buffer(data, header[0] + header[1])
    root = flatbuffer_files._table(buffer, buffer.target(0, "root"), flatbuffer_files.FLAT_TENSOR, "root")
    segments = flatbuffer_files._vector_of_tables(buffer, root[1])
    named = flatbuffer_files._vector_of_tables(buffer, root[2])
    return {
        "header": header,
        "segments": [flatbuffer_files._table(buffer, s, flatbuffer_files.DATA_SEGMENT, "s") for s in segments],
        "named": [flatbuffer_files._table(buffer, n, flatbuffer_files.NAMED_DATA, "n") for n in named],
        "named_tables": named,
    }


def patched(data: bytes, position: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, position, value)
    return bytes(out)


def test_an_exported_weights_file_passes(ptd, bundle, tmp_path):
    check_flat_tensor(ptd)
    check_flat_tensor_file(bundle / "expert_1.ptd")
    (tmp_path / "short.ptd").write_bytes(ptd[:30])
    with pytest.raises(ValueError, match="not a FlatTensor file"):
        check_flat_tensor_file(tmp_path / "short.ptd")


def test_what_executorch_would_read_out_of_bounds_is_refused(ptd):
    found = fields(ptd)
    fb_offset, fb_size, segment_base, segment_size = found["header"]
    # Fields equal to their default (0) are not stored: take entries that store them.
    sized_segment = next(segment for segment in found["segments"] if 1 in segment)
    indexed_entry = next(entry for entry in found["named"] if 1 in entry)
    cases = {
        "a smaller flatbuffer": (patched(ptd, 24, "<Q", fb_size - 200), "outside the flatbuffer"),
        "a flatbuffer into the segments": (patched(ptd, 24, "<Q", segment_base), "runs past"),
        "segment data past the file": (patched(ptd, 40, "<Q", segment_size + 1), "not the end of the file"),
        "segment data moved by a byte": (patched(ptd, 32, "<Q", segment_base - 1), "not the end of the file"),
        "a root offset flipped": (patched(ptd, 0, "<I", 0xB7), "aligned"),
        "a segment past the segment data": (
            patched(ptd, sized_segment[1], "<Q", segment_size + 1),
            "outside the segment data",
        ),
        "a segment index out of range": (
            patched(ptd, indexed_entry[1], "<I", len(found["segments"])),
            "names segment",
        ),
    }
    for name, (damaged, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            check_flat_tensor(damaged)
            pytest.fail(name)


def test_a_named_entry_without_its_key_is_refused(ptd):
    """ExecuTorch strcmp's every key without asking whether it is there: a key slot zeroed in the vtable is refused."""
    found = fields(ptd)
    table = found["named_tables"][0]
    vtable = table - struct.unpack_from("<i", ptd, table)[0]
    with pytest.raises(ValueError, match="lacks its field 0"):
        check_flat_tensor(patched(ptd, vtable + 4, "<H", 0))


@pytest.mark.slow  # runs ExecuTorch on every flip the check accepts: in CI's slow set
def test_no_flipped_byte_of_a_weights_files_header_and_flatbuffer_crashes_executorch(ptd, bundle, tmp_path):
    """Over the part ExecuTorch parses, each flip (all bits, and the lowest one) is refused by the check (offsets,
    lengths, identifiers), or ExecuTorch loads and runs the expert with it (names, padding, scalars that stay in
    bounds) without a signal; the check itself raises nothing but ValueError."""
    fb_offset, fb_size = HEADER.unpack_from(ptd, 8)[2:4]
    accepted = []
    for i, damaged in enumerate(flipped(ptd, fb_offset + fb_size)):
        try:
            check_flat_tensor(damaged)
        except ValueError:
            continue
        accepted.append(tmp_path / f"flip-{i}.ptd")
        accepted[-1].write_bytes(damaged)
    assert accepted  # some bytes are free to change, and ExecuTorch must meet those files
    script = LOAD_AND_RUN.format(tests_export=str(Path(__file__).parent))
    run = subprocess.run([sys.executable, "-c", script, str(bundle), "expert_1", ",".join(map(str, accepted))],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    crashed = run.stdout.strip().splitlines()[-1:] if run.returncode else []
    assert run.returncode == 0, f"signal {-run.returncode} on {crashed}: {run.stderr[-500:]}"


# --- .pte -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["router.pte", "expert.pte"])
def test_an_exported_program_passes_and_its_header_faults_are_refused(bundle, name):
    program = (bundle / name).read_bytes()
    check_graph_file(bundle / name)
    _, _, program_size, segment_base, segment_size = PROGRAM_HEADER.unpack_from(program, 8)
    cases = {
        "the file identifier": (patched(program, 4, "<I", 0xFFFF3245), "no ET12 identifier"),
        "the header magic": (patched(program, 8, "<I", 0), "extended header is damaged"),
        "a program past the file": (patched(program, 16, "<Q", len(program) + 1), "does not fit the file"),
        "segments before the program": (patched(program, 24, "<Q", program_size - 8), "not the end of the file"),
        "segments short of the end": (patched(program, 32, "<Q", segment_size - 1), "not the end of the file"),
        "a root offset past the program": (patched(program, 0, "<I", program_size), "outside the flatbuffer"),
        "a truncated file": (program[: segment_base + segment_size // 2], "not the end of the file"),
    }
    for what, (damaged, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            check_program(damaged)
            pytest.fail(what)


def test_a_backend_id_that_is_not_utf8_is_refused(bundle):
    """ExecuTorch logs a backend it lacks by its id: bytes that are not UTF-8 there would abort the Python process."""
    program = bytearray((bundle / "router.pte").read_bytes())
    at = program.index(b"XnnpackBackend\0")
    program[at] = 0xC3  # a UTF-8 lead byte without its continuation
    with pytest.raises(ValueError, match="not UTF-8"):
        check_program(bytes(program))


LOAD_AND_RUN = """
import sys
from pathlib import Path
sys.path.insert(0, {tests_export!r})
import numpy as np
from mobile_moe.errors import UsageError
from mobile_moe.export.manifest import read_manifest
from executorch_graph import ExecuTorchGraph
bundle, name, variants = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
graph = next(graph for graph in read_manifest(bundle).graphs if graph.name == name)
weights = bundle / graph.weights.file if graph.weights is not None else None
for path in map(Path, variants):
    print(path, flush=True)  # the last one printed is the one that crashed, if one does
    program, data = (bundle / graph.file, path) if path.suffix == ".ptd" else (path, weights)
    try:  # as ExecuTorch's Python runtime loads and runs a graph
        runner = ExecuTorchGraph(program, graph, weights=data)
        runner([np.zeros([int(d) for d in spec.shape], np.float32) for spec in graph.inputs])
    except UsageError:
        pass  # refused by ExecuTorch itself, in one line: what matters is that nothing crashed
"""


@pytest.mark.slow  # runs ExecuTorch or whole commands many times: in CI's slow set
@pytest.mark.parametrize(
    ("name", "graph"), [("router.pte", "router"), ("expert.pte", "expert_1"), ("expert_1.ptd", "expert_1")]
)
def test_no_table_entry_read_as_absent_crashes_executorch(bundle, tmp_path, name, graph):
    """Every field of every table ExecuTorch reads, in a program or a weights file, zeroed in its vtable one at a
    time: the check refuses the variant, or ExecuTorch loads and runs it (or refuses it) without a signal. A zeroed
    named_data, and a named segment's size read as 0, crashed the runtimes before the check refused them."""
    variants = without_each_entry((bundle / name).read_bytes())
    accepted = []
    for i, variant in enumerate(variants):
        path = tmp_path / f"variant-{i}{Path(name).suffix}"
        path.write_bytes(variant)
        try:
            check_graph_file(path, external_data=name == "expert.pte")
        except ValueError:
            continue
        accepted.append(path)
    assert len(variants) > 5 and accepted  # the check refuses some, and ExecuTorch must meet the rest
    script = LOAD_AND_RUN.format(tests_export=str(Path(__file__).parent))
    run = subprocess.run([sys.executable, "-c", script, str(bundle), graph, ",".join(map(str, accepted))],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    crashed = run.stdout.strip().splitlines()[-1:] if run.returncode else []
    assert run.returncode == 0, f"signal {-run.returncode} on {crashed}: {run.stderr[-500:]}"


def test_a_program_without_named_data_is_refused_unless_a_weights_file_comes_with_it(bundle):
    """A router.pte whose named_data entry was zeroed (and re-sealed) crashed predict and the native runner."""
    program = (bundle / "router.pte").read_bytes()
    root = struct.unpack_from("<I", program, 0)[0]
    vtable = root - struct.unpack_from("<i", program, root)[0]
    damaged = patched(program, vtable + 4 + 2 * 7, "<H", 0)  # Program's field 7, named_data, read as absent
    with pytest.raises(ValueError, match="no named data, and no weights file"):
        check_program(damaged)
    check_program(damaged, external_data=True)  # a family's program finds its weights in the .ptd loaded with it


# --- the native library's walk (libmobile_moe/src/flatbuffer_check.h)
# ------------------------------------------------


def flipped(data: bytes, end: int) -> list[bytes]:
    """`data` with each byte before `end` flipped, all its bits and its lowest one, a variant each."""
    variants = []
    for offset in range(end):
        for mask in (0xFF, 0x01):
            damaged = bytearray(data)
            damaged[offset] ^= mask
            variants.append(bytes(damaged))
    return variants


def not_utf8(program: bytes) -> list[bytes]:
    """The program with its backend id's first bytes made each kind of byte sequence strict UTF-8 refuses."""
    at = program.index(b"XnnpackBackend\0")
    sequences = [b"\xc3", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xff", b"\xe2\x82"]
    return [program[:at] + sequence + program[at + len(sequence) :] for sequence in sequences]


def verdicts_of_both(
    internal_checks, tmp_path, variants: list[bytes], suffix: str, external_data: bool
) -> tuple[list, list]:
    """(Python's verdicts, the library's) on each variant written as a file: True for accepted."""
    paths = []
    for i, variant in enumerate(variants):
        paths.append(tmp_path / f"variant-{i}{suffix}")
        paths[-1].write_bytes(variant)
    ours = []
    for path in paths:
        try:
            check_graph_file(path, external_data)
            ours.append(True)
        except ValueError:
            ours.append(False)
    flags = ["--check", *(["--external-data"] if external_data else []), *map(str, paths)]
    run = subprocess.run([str(internal_checks), *flags], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split("  ", 1)[1].split(":")[0] for line in lines] == list(map(str, paths))
    return ours, [line.startswith("ok  ") for line in lines]


def test_the_librarys_walk_gives_a_weights_file_the_same_verdicts(internal_checks, ptd, tmp_path):
    """Every flip of a .ptd's header and flatbuffer: the library refuses exactly what flatbuffer_files.py refuses
    (ExecuTorch's own FlatTensorDataMap verifies nothing)."""
    fb_offset, fb_size = HEADER.unpack_from(ptd, 8)[2:4]
    ours, native = verdicts_of_both(internal_checks, tmp_path, [ptd, *flipped(ptd, fb_offset + fb_size)], ".ptd", False)
    assert ours == native
    assert ours[0] and ours.count(False) > 400  # the exported file passes; many flips do not


@pytest.mark.parametrize("name", ["router.pte", "expert.pte"])
@pytest.mark.parametrize("external_data", [False, True])
def test_the_librarys_walk_gives_a_program_the_same_verdicts(internal_checks, bundle, tmp_path, name, external_data):
    """A program with each table entry read as absent, each flip of its first 512 bytes, and strings that are not
    UTF-8: the library refuses exactly what flatbuffer_files.py refuses, with and without a weights file beside it."""
    program = (bundle / name).read_bytes()
    variants = [program, *without_each_entry(program), *flipped(program, 512), *not_utf8(program)]
    ours, native = verdicts_of_both(internal_checks, tmp_path, variants, ".pte", external_data)
    assert ours == native
    assert ours[0] and ours.count(False) > 100


def test_a_walk_stops_at_its_table_budget(bundle, monkeypatch):
    """Vectors whose entries all point at one shared table would make the walk exponential in the nesting depth: past
    MAX_TABLES tables (1M, ExecuTorch's own verifier's bound) the file is refused instead of walked."""
    check_graph_file(bundle / "router.pte")
    monkeypatch.setattr(flatbuffer_files, "MAX_TABLES", 5)
    with pytest.raises(ValueError, match="more than 5 tables"):
        check_graph_file(bundle / "router.pte")
