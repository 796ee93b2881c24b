"""A .ptd file (ExecuTorch's FlatTensor: a flatbuffer of named tensor data, then the data segments) checked before
ExecuTorch reads it. ExecuTorch verifies a .pte's flatbuffer (Verification::InternalConsistency) but not a .ptd's: a
re-sealed flipped byte in its root offset made `predict` die by SIGSEGV, on some runs only (it depends on what the
garbage offsets point at). This walks the flatbuffer the way flatbuffers' own Verifier does, for FlatTensor's schema
(executorch/extension/flat_tensor/serialize/flat_tensor.fbs), within the bytes ExecuTorch loads for it, and checks
what ExecuTorch then trusts: every named entry has a key and a segment index in range, every segment lies inside the
segment data.

    check_flat_tensor_file(path)   # ValueError naming the first fault; reads the header and flatbuffer only

Layout: uoffset of the root table at 0, file identifier "FT01" at 4, the extended header "FH01" at 8 (its length,
flatbuffer offset and size, segment base offset and size, all little-endian), the flatbuffer's tables, then the
segments from the segment base offset.
"""

from __future__ import annotations

import struct

IDENTIFIER = b"FT01"
HEADER_MAGIC = b"FH01"
HEADER = struct.Struct("<4sIQQQQ")  # magic, length, flatbuffer offset, flatbuffer size, segment base, segment size
MAX_ENTRIES = 1 << 20  # bounds vector lengths (tensors per file): a flipped length cannot make us loop for ever

# Each table: field index -> (kind, size or child table). Kinds: scalar (size in bytes), string, table, vector of
# scalars (element size), vector of tables.
TENSOR_LAYOUT = {0: ("scalar", 1), 1: ("scalars", 4), 2: ("scalars", 1)}  # scalar_type, sizes, dim_order
DATA_SEGMENT = {0: ("scalar", 8), 1: ("scalar", 8)}  # offset, size
NAMED_DATA = {0: ("string", None), 1: ("scalar", 4), 2: ("table", TENSOR_LAYOUT)}  # key, segment_index, layout
REQUIRED = {id(NAMED_DATA): (0,)}  # fields ExecuTorch reads without asking whether they are there (the key: strcmp)
FLAT_TENSOR = {0: ("scalar", 4), 1: ("tables", DATA_SEGMENT), 2: ("tables", NAMED_DATA)}  # version, segments, named


class _Buffer:
    """Bounds- and alignment-checked little-endian reads of the flatbuffer part of the file."""

    def __init__(self, data: bytes, end: int):
        self.data, self.end = data, end

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


def _table(buffer: _Buffer, position: int, schema: dict, what: str) -> dict[int, int]:
    """Verify the table at `position` and its children; -> {field index: field position} of the fields present."""
    vtable = position - buffer.read("<i", position, f"{what}'s vtable offset")
    vtable_size = buffer.read("<H", vtable, f"{what}'s vtable")
    object_size = buffer.read("<H", vtable + 2, f"{what}'s vtable")
    if vtable_size < 4 or vtable_size % 2:
        raise ValueError(f"{what}'s vtable has an impossible size {vtable_size}")
    buffer.need(vtable, vtable_size, 2, f"{what}'s vtable")
    buffer.need(position, object_size, 4, what)
    fields = {}
    for index, (kind, detail) in schema.items():
        slot = 4 + 2 * index
        offset = buffer.read("<H", vtable + slot, f"{what}'s vtable") if slot < vtable_size else 0
        if offset == 0:
            continue
        size = detail if kind == "scalar" else 4
        if offset + size > object_size:
            raise ValueError(f"{what}'s field {index} lies outside the table")
        field = position + offset
        buffer.need(field, size, size, f"{what}'s field {index}")
        _child(buffer, field, kind, detail, f"{what}.{index}")
        fields[index] = field
    missing = [index for index in REQUIRED.get(id(schema), ()) if index not in fields]
    if missing:
        raise ValueError(f"{what} lacks its field {missing[0]}, which ExecuTorch reads unconditionally")
    return fields


def _child(buffer: _Buffer, field: int, kind: str, detail, what: str) -> None:
    if kind == "scalar":
        return
    target = buffer.target(field, what)
    if kind == "table":
        _table(buffer, target, detail, what)
        return
    length = buffer.read("<I", target, f"{what}'s length")
    if length > MAX_ENTRIES:
        raise ValueError(f"{what} claims {length} entries")
    element = 1 if kind == "string" else 4 if kind == "tables" else detail
    buffer.need(target + 4, length * element + (1 if kind == "string" else 0), min(element, 4), what)
    if kind == "string" and buffer.data[target + 4 + length] != 0:
        raise ValueError(f"{what} is a string without its terminating zero")
    if kind == "tables":
        for i in range(length):
            element_position = target + 4 + 4 * i
            _table(buffer, buffer.target(element_position, f"{what}[{i}]"), detail, f"{what}[{i}]")


def check_flat_tensor_file(path) -> None:
    """check_flat_tensor on a file, reading only its header and flatbuffer (not the tensor data after them)."""
    with open(path, "rb") as f:
        head = f.read(8 + HEADER.size)
        size = f.seek(0, 2)
        fb_offset, fb_size = HEADER.unpack_from(head, 8)[2:4] if len(head) == 8 + HEADER.size else (0, 0)
        f.seek(0)
        check_flat_tensor(f.read(max(len(head), min(fb_offset + fb_size, size))), size)


def check_flat_tensor(data: bytes, file_size: int | None = None) -> None:
    """ValueError naming the first way `data` (a whole FlatTensor file, or its first bytes up to the end of its
    flatbuffer, with `file_size` the whole file's size) is not a FlatTensor file ExecuTorch can read safely."""
    file_size = len(data) if file_size is None else file_size
    if len(data) < 8 + HEADER.size or data[4:8] != IDENTIFIER:
        raise ValueError(f"not a FlatTensor file (no {IDENTIFIER.decode()} identifier)")
    magic, length, fb_offset, fb_size, segment_base, segment_size = HEADER.unpack_from(data, 8)
    if magic != HEADER_MAGIC or length < HEADER.size:
        raise ValueError(f"its extended header is damaged (magic {magic!r}, length {length})")
    if segment_size and (segment_base < 8 + HEADER.size or segment_base + segment_size > file_size):
        raise ValueError(f"its segment data ({segment_base} + {segment_size}) lies outside the file ({file_size})")
    # ExecuTorch loads bytes [0, flatbuffer offset + size) and parses the flatbuffer in them: every table lies there.
    end = fb_offset + fb_size
    limit = segment_base if segment_size else file_size
    if end > limit or end > len(data):
        raise ValueError(f"its flatbuffer ({fb_offset} + {fb_size}) runs past {min(limit, len(data))}")
    buffer = _Buffer(data, end)
    root = _table(buffer, buffer.target(0, "the root offset"), FLAT_TENSOR, "FlatTensor")
    segments = _vector_of_tables(buffer, root.get(1))
    for i, segment in enumerate(segments):
        fields = _table(buffer, segment, DATA_SEGMENT, f"segment {i}")
        start, size = (_u64(data, fields.get(k)) for k in (0, 1))
        if start + size > segment_size:
            raise ValueError(f"segment {i} ({start} + {size}) lies outside the segment data ({segment_size})")
    for i, named in enumerate(_vector_of_tables(buffer, root.get(2))):
        index_field = _table(buffer, named, NAMED_DATA, f"named data {i}").get(1)
        index = struct.unpack_from("<I", data, index_field)[0] if index_field is not None else 0
        if index >= len(segments):
            raise ValueError(f"named data {i} refers to segment {index}, of {len(segments)}")


def _vector_of_tables(buffer: _Buffer, field: int | None) -> list[int]:
    """The table positions of an (already verified) vector-of-tables field; [] when absent."""
    if field is None:
        return []
    target = buffer.target(field, "vector")
    length = buffer.read("<I", target, "vector length")
    return [buffer.target(target + 4 + 4 * i, "vector element") for i in range(length)]


def _u64(data: bytes, field: int | None) -> int:
    return struct.unpack_from("<Q", data, field)[0] if field is not None else 0
