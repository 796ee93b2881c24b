"""ExecuTorch's files checked before ExecuTorch reads them: a program (.pte) and a named-data file (.ptd).

ExecuTorch trusts more of these files than it verifies, and what it does not verify can crash the process:
- a .ptd (FlatTensor) is not verified at all: a re-sealed flipped byte in its root offset made `predict` die by
  SIGSEGV, on some runs only (it depends on what the garbage offsets point at);
- a .pte's header is read before its flatbuffer is verified, and its log lines quote the file's bytes: a flipped file
  identifier (bytes 4-7) is logged raw, the Python bindings' stderr redirect (pybind11's pythonbuf) cannot decode it
  as UTF-8, and the process aborts (SIGABRT). Operator names, backend ids and named-data keys are logged the same way.

So each file is walked the way flatbuffers' own Verifier would, for the tables ExecuTorch reads, within the bytes
ExecuTorch loads for it; every string on the way must be UTF-8; every table entry ExecuTorch reads without asking
whether it is there must be there; and what ExecuTorch then trusts (segments inside the file and in order, indices
in range) is checked. The one entry point is `check_graph_file(path, external_data)`, which the bundle's file
verification (mobile_moe/export/manifest.py) calls after a file's sha256 matched: the Python runtime, bench and the push
to a device all go through it.

Layouts (all little-endian):
  .pte  uoffset of the root Program at 0, "ET12" at 4, the extended header "eh00" at 8: its length (u32), program
        size, segment base offset, segment data size (u64 each); the flatbuffer is bytes [0, program size); segments
        follow from the segment base offset (executorch/schema/program.fbs, schema/extended_header.h).
  .ptd  uoffset of the root FlatTensor at 0, "FT01" at 4, the extended header "FH01" at 8: its length, flatbuffer
        offset and size, segment base offset and size (executorch/extension/flat_tensor/serialize/flat_tensor.fbs).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

MAX_ENTRIES = 1 << 20  # bounds vector lengths: a flipped length cannot make us loop for ever
# Bounds the tables one walk visits: vectors whose entries all point at one shared table (a few bytes each) would
# otherwise cost a walk of entries to the power of the nesting depth. ExecuTorch's own verifier stops at 1M tables.
MAX_TABLES = 1 << 20


@dataclass(frozen=True)
class Table:
    """A flatbuffer table's schema: field index -> (kind, detail), and the fields ExecuTorch reads without asking
    whether they are there. Kinds: scalar (detail: size in bytes), string, table (detail: Table), scalars (a vector
    of scalars; detail: element size), tables (a vector of tables; detail: Table). Fields not listed are skipped."""

    fields: dict[int, tuple[str, object]]
    required: tuple[int, ...] = field(default=())


# --- the walk ---------------------------------------------------------------------------------------------------------


class _Buffer:
    """Bounds- and alignment-checked little-endian reads of the flatbuffer part of a file."""

    def __init__(self, data: bytes, end: int):
        self.data, self.end = data, end
        self.tables = 0  # walked so far (MAX_TABLES)

    def need(self, position: int, size: int, align: int, what: str) -> None:
        if position < 0 or size < 0 or position + size > self.end:
            raise ValueError(f"{what} at {position} (+{size}) lies outside the flatbuffer (0..{self.end})")
        if position % align:
            raise ValueError(f"{what} at {position} is not {align}-byte aligned")

    def read(self, fmt: str, position: int, what: str) -> int:
        size = struct.calcsize(fmt)
        self.need(position, size, size, what)
        return struct.unpack_from(fmt, self.data, position)[0]

    def target(self, position: int, what: str) -> int:
        """Where the uoffset at `position` points."""
        return position + self.read("<I", position, what)


def _table(buffer: _Buffer, position: int, schema: Table, what: str) -> dict[int, int]:
    """Verify the table at `position` and its children; -> {field index: field position} of the fields present."""
    buffer.tables += 1
    if buffer.tables > MAX_TABLES:
        raise ValueError(f"it holds more than {MAX_TABLES} tables")
    vtable = position - buffer.read("<i", position, f"{what}'s vtable offset")
    vtable_size = buffer.read("<H", vtable, f"{what}'s vtable")
    object_size = buffer.read("<H", vtable + 2, f"{what}'s vtable")
    if vtable_size < 4 or vtable_size % 2:
        raise ValueError(f"{what}'s vtable has an impossible size {vtable_size}")
    buffer.need(vtable, vtable_size, 2, f"{what}'s vtable")
    buffer.need(position, object_size, 4, what)
    fields = {}
    for index, (kind, detail) in schema.fields.items():
        slot = 4 + 2 * index
        offset = buffer.read("<H", vtable + slot, f"{what}'s vtable") if slot < vtable_size else 0
        if offset == 0:
            continue
        size = detail if kind == "scalar" else 4
        if offset + size > object_size:
            raise ValueError(f"{what}'s field {index} lies outside the table")
        position_of_field = position + offset
        buffer.need(position_of_field, size, size, f"{what}'s field {index}")
        _child(buffer, position_of_field, kind, detail, f"{what}.{index}")
        fields[index] = position_of_field
    missing = [index for index in schema.required if index not in fields]
    if missing:
        raise ValueError(f"{what} lacks its field {missing[0]}, which ExecuTorch reads unconditionally")
    return fields


def _child(buffer: _Buffer, position: int, kind: str, detail, what: str) -> None:
    if kind == "scalar":
        return
    target = buffer.target(position, what)
    if kind == "table":
        _table(buffer, target, detail, what)
        return
    length = buffer.read("<I", target, f"{what}'s length")
    if length > MAX_ENTRIES:
        raise ValueError(f"{what} claims {length} entries")
    element = 1 if kind == "string" else 4 if kind == "tables" else detail
    buffer.need(target + 4, length * element + (1 if kind == "string" else 0), min(element, 4), what)
    if kind == "string":
        if buffer.data[target + 4 + length] != 0:
            raise ValueError(f"{what} is a string without its terminating zero")
        try:  # ExecuTorch logs these strings; its Python bindings abort on bytes that are not UTF-8
            buffer.data[target + 4 : target + 4 + length].decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{what} is a string that is not UTF-8") from None
    if kind == "tables":
        for i in range(length):
            _table(buffer, buffer.target(target + 4 + 4 * i, f"{what}[{i}]"), detail, f"{what}[{i}]")


def _vector_of_tables(buffer: _Buffer, position: int | None) -> list[int]:
    """The table positions of an (already verified) vector-of-tables field; [] when absent."""
    if position is None:
        return []
    target = buffer.target(position, "vector")
    length = buffer.read("<I", target, "vector length")
    return [buffer.target(target + 4 + 4 * i, "vector element") for i in range(length)]


def _scalar(data: bytes, fmt: str, position: int | None) -> int:
    return struct.unpack_from(fmt, data, position)[0] if position is not None else 0


# The most padding the serializer puts between segments (its segment alignment is 128; a page at the most): a longer
# gap is a segment size read short, after which a delegate reads its weights past the segment's end.
MAX_SEGMENT_PADDING = 4096


def _check_segments(buffer: _Buffer, segments: list[int], segment_data_size: int, schema: Table) -> list[int]:
    """Each segment inside the segment data, after the one before it with at most the serializer's padding between:
    the serializer lays them out in order, end to end, and one that overlaps another (an offset read as absent is 0)
    feeds a delegate bytes that are not its own, which XNNPACK then logs as garbage (and the Python bindings abort
    on). -> each segment's size."""
    end_of_previous, sizes = 0, []
    for i, segment in enumerate(segments):
        fields = _table(buffer, segment, schema, f"segment {i}")
        start, size = (_scalar(buffer.data, "<Q", fields.get(k)) for k in (SEGMENT_OFFSET, SEGMENT_SIZE))
        if start + size > segment_data_size:
            raise ValueError(f"segment {i} ({start} + {size}) lies outside the segment data ({segment_data_size})")
        if start < end_of_previous:
            raise ValueError(f"segment {i} starts at {start}, inside the segment before it (which ends at "
                             f"{end_of_previous})")  # fmt: skip
        if start - end_of_previous >= MAX_SEGMENT_PADDING:
            raise ValueError(f"segment {i} starts {start - end_of_previous} bytes after the one before it ends")
        end_of_previous = start + size
        sizes.append(size)
    if segments and segment_data_size - end_of_previous >= MAX_SEGMENT_PADDING:
        raise ValueError(f"the last segment ends {segment_data_size - end_of_previous} bytes before the segment data")
    return sizes


def _check_references(buffer: _Buffer, tables: list[int], schema: Table, index_field: int, sizes: list[int],
                      what: str) -> None:  # fmt: skip
    """The segment that each of `tables` names in its field `index_field` exists and is not empty: ExecuTorch's
    loaders hand an empty segment over as a null pointer (extension/data_loader/mmap_data_loader.cpp, load), and
    XNNPACK copies weights from it without asking its size (backends/xnnpack/runtime/XNNCompiler.cpp,
    getConstantDataPtr): a named segment's size read as 0 crashed the native runner."""
    for i, table in enumerate(tables):
        index = _scalar(buffer.data, "<I", _table(buffer, table, schema, f"{what} {i}").get(index_field))
        if index >= len(sizes):
            raise ValueError(f"{what} {i} names segment {index}, of {len(sizes)}")
        if sizes[index] == 0:
            raise ValueError(f"{what} {i} names segment {index}, which is empty")


def _read_head(path: str | Path, header: struct.Struct, flatbuffer_end) -> tuple[bytes, int]:
    """(the file's bytes up to the end of its flatbuffer, the file's size), reading nothing after the flatbuffer."""
    with open(path, "rb") as f:
        head = f.read(8 + header.size)
        size = f.seek(0, 2)
        end = flatbuffer_end(header.unpack_from(head, 8)) if len(head) == 8 + header.size else 0
        f.seek(0)
        return f.read(max(len(head), min(end, size))), size


# --- .ptd: FlatTensor -------------------------------------------------------------------------------------------------

FLAT_TENSOR_IDENTIFIER = b"FT01"
FLAT_TENSOR_HEADER_MAGIC = b"FH01"
FLAT_TENSOR_HEADER = struct.Struct("<4sIQQQQ")  # at byte 8
FLAT_TENSOR_HEADER_FIELDS = ("magic", "length", "flatbuffer_offset", "flatbuffer_size", "segment_base", "segment_size")

DATA_SEGMENT = Table({0: ("scalar", 8), 1: ("scalar", 8)})  # offset, size (both files' DataSegment)
SEGMENT_OFFSET, SEGMENT_SIZE = 0, 1
TENSOR_LAYOUT = Table({0: ("scalar", 1), 1: ("scalars", 4), 2: ("scalars", 1)})  # scalar_type, sizes, dim_order
NAMED_DATA = Table({0: ("string", None), 1: ("scalar", 4), 2: ("table", TENSOR_LAYOUT)}, required=(0,))  # key: strcmp
FLAT_TENSOR = Table({0: ("scalar", 4), 1: ("tables", DATA_SEGMENT), 2: ("tables", NAMED_DATA)})  # version, ...
# The fields the file-level checks read: FlatTensor's segments and named data, and a NamedData's segment index.
FLAT_TENSOR_SEGMENTS, FLAT_TENSOR_NAMED_DATA, NAMED_DATA_SEGMENT = 1, 2, 1


def check_flat_tensor_file(path: str | Path) -> None:
    """check_flat_tensor on a file, reading only its header and flatbuffer (not the tensor data after them)."""
    check_flat_tensor(*_read_head(path, FLAT_TENSOR_HEADER, lambda fields: fields[2] + fields[3]))


def check_flat_tensor(data: bytes, file_size: int | None = None) -> None:
    """ValueError naming the first way `data` (a whole FlatTensor file, or its first bytes up to the end of its
    flatbuffer, with `file_size` the whole file's size) is not a FlatTensor file ExecuTorch can read safely."""
    file_size = len(data) if file_size is None else file_size
    if len(data) < 8 + FLAT_TENSOR_HEADER.size or data[4:8] != FLAT_TENSOR_IDENTIFIER:
        raise ValueError(f"not a FlatTensor file (no {FLAT_TENSOR_IDENTIFIER.decode()} identifier)")
    magic, length, fb_offset, fb_size, segment_base, segment_size = FLAT_TENSOR_HEADER.unpack_from(data, 8)
    if magic != FLAT_TENSOR_HEADER_MAGIC or length < FLAT_TENSOR_HEADER.size:
        raise ValueError(f"its extended header is damaged (magic {magic!r}, length {length})")
    # ExecuTorch loads bytes [0, flatbuffer offset + size) and parses the flatbuffer in them: every table lies there.
    end = fb_offset + fb_size
    limit = segment_base if segment_size else file_size
    if end > limit or end > len(data):
        raise ValueError(f"its flatbuffer ({fb_offset} + {fb_size}) runs past {min(limit, len(data))}")
    # The serializer ends the file with the segment data. ExecuTorch checks only that it fits in the file, and a
    # segment base moved by a byte fed the weights shifted data: NaN logits, and no error.
    if segment_size and segment_base + segment_size != file_size:
        raise ValueError(f"its segment data ({segment_base} + {segment_size}) is not the end of the file ({file_size})")
    buffer = _Buffer(data, end)
    root = _table(buffer, buffer.target(0, "the root offset"), FLAT_TENSOR, "FlatTensor")
    sizes = _check_segments(buffer, _vector_of_tables(buffer, root.get(FLAT_TENSOR_SEGMENTS)), segment_size,
                            DATA_SEGMENT)  # fmt: skip
    named = _vector_of_tables(buffer, root.get(FLAT_TENSOR_NAMED_DATA))
    _check_references(buffer, named, NAMED_DATA, NAMED_DATA_SEGMENT, sizes, "named data")


# --- .pte: Program ----------------------------------------------------------------------------------------------------

PROGRAM_IDENTIFIER = b"ET12"  # the only one ExecuTorch 1.5 loads (runtime/executor/program.cpp)
PROGRAM_HEADER_MAGIC = b"eh00"
PROGRAM_HEADER = struct.Struct("<4sIQQQ")  # at byte 8
PROGRAM_HEADER_FIELDS = ("magic", "length", "program_size", "segment_base", "segment_size")

# The tables whose strings ExecuTorch logs (an operator it lacks, a backend it lacks, a key a data map lacks, a method
# name), and the segments it trusts. Values (EValues, a union) are left to ExecuTorch's own verification.
OPERATOR = Table({0: ("string", None), 1: ("string", None)})  # name, overload
COMPILE_SPEC = Table({0: ("string", None), 1: ("scalars", 1)})  # key, value
DELEGATE_DATA = Table({0: ("scalar", 1), 1: ("scalar", 4)})  # location (inline / segment), index
BACKEND_DELEGATE = Table({0: ("string", None), 1: ("table", DELEGATE_DATA), 2: ("tables", COMPILE_SPEC)})
CONTAINER_METADATA = Table({0: ("string", None), 1: ("string", None)})
ANY_TABLE = Table({})  # a table walked for its structure only (EValues and instructions are unions)
INSTRUCTION = Table({0: ("scalar", 1), 1: ("table", ANY_TABLE)}, required=(0, 1))  # kind, arguments
CHAIN = Table({0: ("scalars", 4), 1: ("scalars", 4), 2: ("tables", INSTRUCTION)}, required=(0, 1, 2))
# Method::init and MethodMeta read every one of these without asking whether it is there: name (a method is looked
# up by it), values, inputs, outputs, chains, operators, delegates, non_const_buffer_sizes.
EXECUTION_PLAN = Table(
    {
        0: ("string", None),
        1: ("table", CONTAINER_METADATA),
        2: ("tables", ANY_TABLE),  # values
        3: ("scalars", 4),  # inputs
        4: ("scalars", 4),  # outputs
        5: ("tables", CHAIN),
        6: ("tables", OPERATOR),
        7: ("tables", BACKEND_DELEGATE),
        8: ("scalars", 8),  # non_const_buffer_sizes
    },
    required=(0, 2, 3, 4, 5, 6, 7, 8),
)
SUBSEGMENT_OFFSETS = Table({0: ("scalar", 4), 1: ("scalars", 8)})  # segment_index, offsets
PROGRAM_NAMED_DATA = Table({0: ("string", None), 1: ("scalar", 4)})  # key, segment_index
PROGRAM = Table(
    {
        0: ("scalar", 4),  # version
        1: ("tables", EXECUTION_PLAN),
        4: ("tables", DATA_SEGMENT),
        5: ("table", SUBSEGMENT_OFFSETS),  # constant_segment
        6: ("tables", SUBSEGMENT_OFFSETS),  # mutable_data_segments
        7: ("tables", PROGRAM_NAMED_DATA),
    },
    required=(1,),
)
# The fields the file-level checks read: Program's segments, mutable data segments and named data, and the segment
# index of a SubsegmentOffsets and of a program's NamedData.
PROGRAM_SEGMENTS, PROGRAM_MUTABLE_DATA_SEGMENTS, PROGRAM_NAMED_DATA_FIELD = 4, 6, 7
SUBSEGMENT_OFFSETS_SEGMENT, PROGRAM_NAMED_DATA_SEGMENT = 0, 1


def check_program_file(path: str | Path, external_data: bool = False) -> None:
    """check_program on a file, reading only its header and flatbuffer (not the segments after them)."""
    check_program(*_read_head(path, PROGRAM_HEADER, lambda fields: fields[2]), external_data=external_data)


def check_program(data: bytes, file_size: int | None = None, *, external_data: bool = False) -> None:
    """ValueError naming the first way `data` (a whole .pte, or its first bytes up to the end of its flatbuffer, with
    `file_size` the whole file's size) is not a program ExecuTorch can read safely. Our exporter always writes the
    extended header (its programs keep delegate data in segments), so a file without one is refused too.
    `external_data`: a weights file (.ptd) is loaded with the program, so its delegates may find their data there."""
    file_size = len(data) if file_size is None else file_size
    if len(data) < 8 + PROGRAM_HEADER.size or data[4:8] != PROGRAM_IDENTIFIER:
        raise ValueError(f"not an ExecuTorch program (no {PROGRAM_IDENTIFIER.decode()} identifier)")
    magic, length, program_size, segment_base, segment_size = PROGRAM_HEADER.unpack_from(data, 8)
    if magic != PROGRAM_HEADER_MAGIC or length < PROGRAM_HEADER.size:
        raise ValueError(f"its extended header is damaged (magic {magic!r}, length {length})")
    if not 8 + 8 + PROGRAM_HEADER.size <= program_size <= min(len(data), file_size):
        raise ValueError(f"its program size {program_size} does not fit the file ({file_size})")
    # The exporter places the segments after the flatbuffer and ends the file with them: anything else is damage.
    if segment_size and (segment_base < program_size or segment_base + segment_size != file_size):
        raise ValueError(f"its segment data ({segment_base} + {segment_size}) is not the end of the file ({file_size})")
    buffer = _Buffer(data, program_size)
    root = _table(buffer, buffer.target(0, "the root offset"), PROGRAM, "Program")
    if PROGRAM_NAMED_DATA_FIELD not in root and not external_data:
        # XNNPACK's delegate asks for its weights without asking whether a named-data map exists: a program whose
        # named_data was zeroed crashed predict and the native runner (SIGSEGV). Ours carry it, or a weights file.
        raise ValueError("it has no named data, and no weights file comes with it: its delegates' weights are nowhere")
    sizes = _check_segments(buffer, _vector_of_tables(buffer, root.get(PROGRAM_SEGMENTS)), segment_size, DATA_SEGMENT)
    # ExecuTorch checks the constant segment's index itself (program.cpp, Program::load); these it looks up later.
    mutable = _vector_of_tables(buffer, root.get(PROGRAM_MUTABLE_DATA_SEGMENTS))
    _check_references(buffer, mutable, SUBSEGMENT_OFFSETS, SUBSEGMENT_OFFSETS_SEGMENT, sizes, "mutable data")
    named = _vector_of_tables(buffer, root.get(PROGRAM_NAMED_DATA_FIELD))
    _check_references(buffer, named, PROGRAM_NAMED_DATA, PROGRAM_NAMED_DATA_SEGMENT, sizes, "named data")


def check_graph_file(path: str | Path, external_data: bool = False) -> None:
    """ValueError naming the first fault of an ExecuTorch file (by its suffix) that would be unsafe to hand to
    ExecuTorch; other files (ONNX, Core ML) are their runtimes' to check. `external_data`: a program's graph loads a
    weights file with it (the manifest's `weights`)."""
    suffix = Path(path).suffix
    if suffix == ".pte":
        check_program_file(path, external_data)
    elif suffix == ".ptd":
        check_flat_tensor_file(path)


# --- the native runner's copy: generated, never edited ----------------------------------------------------------------

CPP_HEADER = "libmobile_moe/src/flatbuffer_schema.h"
_KINDS = ("scalar", "string", "table", "scalars", "tables")


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.lower().split("_"))


def _header_offsets(file: str, header: struct.Struct, names: tuple[str, ...]) -> list[str]:
    """`constexpr int64_t k{file}{Name}At = ...;` for where each field of an extended header (at byte 8) lies."""
    items = re.findall(r"(\d*)([a-zA-Z])", header.format.lstrip("<"))
    lines, at = [], 8
    for (count, code), name in zip(items, names, strict=True):
        lines.append(f"constexpr int64_t k{file}{_camel(name)}At = {at};")
        at += struct.calcsize("<" + count + code)
    return lines


def cpp_header() -> str:
    """libmobile_moe/src/flatbuffer_schema.h: the tables this module walks (their fields, kinds and
    required entries), the extended headers' layouts and identifiers, and the fields the file-level checks read, for the
    runner's own walk (libmobile_moe/src/flatbuffer_check.h): one owner of what a safe file is, in
    both languages (tests/test_docs.py compares the committed file with this; tests/export/test_flatbuffer_files.py
    fuzzes both walks)."""
    tables = {name: value for name, value in globals().items() if isinstance(value, Table)}
    order = list(tables)
    lines = [
        "// Generated from mobile_moe/export/flatbuffer_files.py, the one description of the ExecuTorch files we",
        "// accept, by",
        f"//   python -m mobile_moe.export.flatbuffer_files --cpp-header > {CPP_HEADER}",
        "// Do not edit: change flatbuffer_files.py and regenerate (tests/test_docs.py compares the two).",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
        "namespace mobile_moe::library::flatbuffer_schema {",
        "",
        f"constexpr int64_t kMaxEntries = {MAX_ENTRIES};  // vector lengths",
        f"constexpr int64_t kMaxTables = {MAX_TABLES};  // tables one walk visits",
        f"constexpr uint64_t kMaxSegmentPadding = {MAX_SEGMENT_PADDING};  // between segments, and after the last",
        "",
        "// A table field's kind: a scalar of `size` bytes, a string, a table, a vector of scalars of `size` bytes",
        "// or a vector of tables; `table` indexes kTables (-1: none).",
        f"enum class Kind {{ {', '.join(_camel(kind) for kind in _KINDS)} }};",
        "struct Field {",
        "  int index;",
        "  Kind kind;",
        "  int size;",
        "  int table;",
        "};",
        "struct Table {",
        "  const char* name;",
        "  const Field* fields;",
        "  int num_fields;",
        "  const int* required;  // the fields ExecuTorch reads without asking whether they are there",
        "  int num_required;",
        "};",
        "",
    ]
    for name, table in tables.items():
        fields = []
        for index, (kind, detail) in table.fields.items():
            child = order.index(next(n for n, t in tables.items() if t is detail)) if isinstance(detail, Table) else -1
            size = detail if isinstance(detail, int) else 4 if kind in ("table", "tables", "string") else 0
            fields.append(f"{{{index}, Kind::{_camel(kind)}, {size}, {child}}}")
        required = ", ".join(map(str, table.required)) or "-1"
        lines += [
            f"inline constexpr Field k{_camel(name)}Fields[] = {{{', '.join(fields) or '{-1, Kind::Scalar, 0, -1}'}}};",
            f"inline constexpr int k{_camel(name)}Required[] = {{{required}}};",
        ]
    entries = [f"  {{\"{_camel(name)}\", k{_camel(name)}Fields, {len(t.fields)}, k{_camel(name)}Required, "
               f"{len(t.required)}}}," for name, t in tables.items()]  # fmt: skip
    lines += ["", "inline constexpr Table kTables[] = {", *entries, "};"]
    lines += [f"constexpr int k{_camel(name)} = {i};" for i, name in enumerate(order)]
    lines += [
        "",
        "// The extended headers (at byte 8) and the file identifiers (at byte 4).",
        f"inline constexpr char kProgramIdentifier[] = {json.dumps(PROGRAM_IDENTIFIER.decode())};",
        f"inline constexpr char kProgramHeaderMagic[] = {json.dumps(PROGRAM_HEADER_MAGIC.decode())};",
        f"constexpr int64_t kProgramHeaderSize = {PROGRAM_HEADER.size};",
        *_header_offsets("Program", PROGRAM_HEADER, PROGRAM_HEADER_FIELDS),
        f"inline constexpr char kFlatTensorIdentifier[] = {json.dumps(FLAT_TENSOR_IDENTIFIER.decode())};",
        f"inline constexpr char kFlatTensorHeaderMagic[] = {json.dumps(FLAT_TENSOR_HEADER_MAGIC.decode())};",
        f"constexpr int64_t kFlatTensorHeaderSize = {FLAT_TENSOR_HEADER.size};",
        *_header_offsets("FlatTensor", FLAT_TENSOR_HEADER, FLAT_TENSOR_HEADER_FIELDS),
        "",
        "// The fields the file-level checks read.",
    ]
    for name in ("SEGMENT_OFFSET", "SEGMENT_SIZE", "FLAT_TENSOR_SEGMENTS", "FLAT_TENSOR_NAMED_DATA",
                 "NAMED_DATA_SEGMENT", "PROGRAM_SEGMENTS", "PROGRAM_MUTABLE_DATA_SEGMENTS", "PROGRAM_NAMED_DATA_FIELD",
                 "SUBSEGMENT_OFFSETS_SEGMENT", "PROGRAM_NAMED_DATA_SEGMENT"):  # fmt: skip
        lines.append(f"constexpr int k{_camel(name)} = {globals()[name]};")
    lines += ["", "}  // namespace mobile_moe::library::flatbuffer_schema", ""]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m mobile_moe.export.flatbuffer_files --cpp-header > CPP_HEADER
    import sys

    if sys.argv[1:] != ["--cpp-header"]:
        sys.exit("usage: python -m mobile_moe.export.flatbuffer_files --cpp-header")
    print(cpp_header(), end="")
