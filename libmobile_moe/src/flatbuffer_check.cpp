// flatbuffer_check.h: the walk of an ExecuTorch file's flatbuffer, step for step flatbuffer_files.py's.
#include "flatbuffer_check.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "flatbuffer_schema.h"

namespace mobile_moe::library {

namespace flatbuffer_walk {

namespace fs = flatbuffer_schema;

// Whether bytes [begin, end) are UTF-8 as Python's strict decoder reads it (no overlong forms, no surrogates, nothing
// above U+10FFFF): ExecuTorch logs these strings, and its Python bindings abort on anything else.
bool is_utf8(const uint8_t* begin, const uint8_t* end) {
  while (begin < end) {
    const uint8_t lead = *begin;
    int length = lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3 : (lead >> 3) == 0x1E ? 4 : 0;
    if (length == 0 || end - begin < length) return false;
    uint32_t code = length == 1 ? lead : lead & (0x7F >> length);
    for (int i = 1; i < length; ++i) {
      if ((begin[i] & 0xC0) != 0x80) return false;
      code = (code << 6) | (begin[i] & 0x3F);
    }
    static constexpr uint32_t kLeast[] = {0, 0, 0x80, 0x800, 0x10000};
    if (code < kLeast[length] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return false;
    begin += length;
  }
  return true;
}

// The little-endian T at `at` of `data`, unchecked: where the caller knows the bytes are there.
template <typename T>
T little_endian(const std::vector<uint8_t>& data, int64_t at) {
  uint64_t value = 0;
  for (int i = static_cast<int>(sizeof(T)) - 1; i >= 0; --i) value = (value << 8) | data[at + i];
  T out;
  std::memcpy(&out, &value, sizeof(T));  // the low sizeof(T) bytes: this runs on little-endian machines only
  return out;
}

// Bounds- and alignment-checked little-endian reads of a file's flatbuffer part, bytes [0, end).
class Buffer {
 public:
  Buffer(const std::vector<uint8_t>& data, int64_t end) : data_(data), end_(end) {}

  void need(int64_t position, int64_t size, int64_t align, const std::string& what) const {
    if (position < 0 || size < 0 || position + size > end_)
      throw FileFault(what + " at " + std::to_string(position) + " (+" + std::to_string(size) +
                      ") lies outside the flatbuffer (0.." + std::to_string(end_) + ")");
    if (position % align) throw FileFault(what + " at " + std::to_string(position) + " is not aligned");
  }

  template <typename T>
  T read(int64_t position, const std::string& what) const {
    need(position, sizeof(T), sizeof(T), what);
    return little_endian<T>(data_, position);
  }

  int64_t target(int64_t position, const std::string& what) const {  // where the uoffset at `position` points
    return position + read<uint32_t>(position, what);
  }

  const std::vector<uint8_t>& data() const { return data_; }

  void count_table() const {  // one more table walked (kMaxTables: flatbuffer_files.py's MAX_TABLES says why)
    if (++tables_ > fs::kMaxTables)
      throw FileFault("it holds more than " + std::to_string(fs::kMaxTables) + " tables");
  }

 private:
  const std::vector<uint8_t>& data_;
  int64_t end_;
  mutable int64_t tables_ = 0;
};

using Present = std::map<int, int64_t>;  // field index -> the field's position, for the fields present

Present table(const Buffer& buffer, int64_t position, int schema, const std::string& what);

void child(const Buffer& buffer, int64_t position, const fs::Field& field, const std::string& what) {
  if (field.kind == fs::Kind::Scalar) return;
  const int64_t target = buffer.target(position, what);
  if (field.kind == fs::Kind::Table) {
    table(buffer, target, field.table, what);
    return;
  }
  const int64_t length = buffer.read<uint32_t>(target, what + "'s length");
  if (length > fs::kMaxEntries) throw FileFault(what + " claims " + std::to_string(length) + " entries");
  const bool string = field.kind == fs::Kind::String;
  const int64_t element = string ? 1 : field.size;
  buffer.need(target + 4, length * element + (string ? 1 : 0), std::min<int64_t>(element, 4), what);
  const uint8_t* chars = buffer.data().data() + target + 4;
  if (string && chars[length] != 0) throw FileFault(what + " is a string without its terminating zero");
  if (string && !is_utf8(chars, chars + length)) throw FileFault(what + " is a string that is not UTF-8");
  if (field.kind == fs::Kind::Tables)
    for (int64_t i = 0; i < length; ++i) {
      const std::string item = what + "[" + std::to_string(i) + "]";
      table(buffer, buffer.target(target + 4 + 4 * i, item), field.table, item);
    }
}

// Verify the table at `position` (of kTables[schema]) and its children; -> the fields present.
Present table(const Buffer& buffer, int64_t position, int schema, const std::string& what) {
  const fs::Table& spec = fs::kTables[schema];
  buffer.count_table();
  const int64_t vtable = position - buffer.read<int32_t>(position, what + "'s vtable offset");
  const int64_t vtable_size = buffer.read<uint16_t>(vtable, what + "'s vtable");
  const int64_t object_size = buffer.read<uint16_t>(vtable + 2, what + "'s vtable");
  if (vtable_size < 4 || vtable_size % 2)
    throw FileFault(what + "'s vtable has an impossible size " + std::to_string(vtable_size));
  buffer.need(vtable, vtable_size, 2, what + "'s vtable");
  buffer.need(position, object_size, 4, what);
  Present present;
  for (int i = 0; i < spec.num_fields; ++i) {
    const fs::Field& field = spec.fields[i];
    const int64_t slot = 4 + 2 * field.index;
    const int64_t offset = slot < vtable_size ? buffer.read<uint16_t>(vtable + slot, what + "'s vtable") : 0;
    if (offset == 0) continue;
    const int64_t size = field.kind == fs::Kind::Scalar ? field.size : 4;
    const std::string name = what + "." + std::to_string(field.index);
    if (offset + size > object_size)
      throw FileFault(what + "'s field " + std::to_string(field.index) + " lies outside the table");
    buffer.need(position + offset, size, size, what + "'s field " + std::to_string(field.index));
    child(buffer, position + offset, field, name);
    present[field.index] = position + offset;
  }
  for (int i = 0; i < spec.num_required; ++i)
    if (!present.count(spec.required[i]))
      throw FileFault(what + " lacks its field " + std::to_string(spec.required[i]) +
                      ", which ExecuTorch reads unconditionally");
  return present;
}

// The table positions of an (already verified) vector-of-tables field; none when absent.
std::vector<int64_t> vector_of_tables(const Buffer& buffer, const Present& fields, int index) {
  std::vector<int64_t> tables;
  auto found = fields.find(index);
  if (found == fields.end()) return tables;
  const int64_t target = buffer.target(found->second, "vector");
  const int64_t length = buffer.read<uint32_t>(target, "vector length");
  for (int64_t i = 0; i < length; ++i) tables.push_back(buffer.target(target + 4 + 4 * i, "vector element"));
  return tables;
}

template <typename T>
T scalar(const Buffer& buffer, const Present& fields, int index) {  // 0 when absent
  auto found = fields.find(index);
  return found == fields.end() ? T{0} : little_endian<T>(buffer.data(), found->second);
}

// Each segment inside the segment data, after the one before it with at most kMaxSegmentPadding between
// (flatbuffer_files.py, _check_segments, says why); -> each segment's size.
std::vector<uint64_t> check_segments(const Buffer& buffer, const std::vector<int64_t>& segments,
                                     uint64_t segment_data_size) {
  uint64_t end_of_previous = 0;
  std::vector<uint64_t> sizes;
  for (size_t i = 0; i < segments.size(); ++i) {
    const std::string what = "segment " + std::to_string(i);
    const Present fields = table(buffer, segments[i], fs::kDataSegment, what);
    const uint64_t start = scalar<uint64_t>(buffer, fields, fs::kSegmentOffset);
    const uint64_t size = scalar<uint64_t>(buffer, fields, fs::kSegmentSize);
    if (size > segment_data_size || start > segment_data_size - size)
      throw FileFault(what + " lies outside the segment data (" + std::to_string(segment_data_size) + ")");
    if (start < end_of_previous) throw FileFault(what + " starts inside the segment before it");
    if (start - end_of_previous >= fs::kMaxSegmentPadding)
      throw FileFault(what + " starts " + std::to_string(start - end_of_previous) + " bytes after the one before it");
    end_of_previous = start + size;
    sizes.push_back(size);
  }
  if (!segments.empty() && segment_data_size - end_of_previous >= fs::kMaxSegmentPadding)
    throw FileFault("the last segment ends " + std::to_string(segment_data_size - end_of_previous) +
                    " bytes before the segment data");
  return sizes;
}

// The segment that each of `tables` (of kTables[schema]) names in its field `index` exists and is not empty
// (flatbuffer_files.py, _check_references, says why: an empty one crashed this runner).
void check_references(const Buffer& buffer, const std::vector<int64_t>& tables, int schema, int index,
                      const std::vector<uint64_t>& sizes, const std::string& what) {
  for (size_t i = 0; i < tables.size(); ++i) {
    const std::string item = what + " " + std::to_string(i);
    const uint32_t segment = scalar<uint32_t>(buffer, table(buffer, tables[i], schema, item), index);
    if (segment >= sizes.size())
      throw FileFault(item + " names segment " + std::to_string(segment) + ", of " + std::to_string(sizes.size()));
    if (sizes[segment] == 0) throw FileFault(item + " names segment " + std::to_string(segment) + ", which is empty");
  }
}

struct Head {
  std::vector<uint8_t> data;  // the file up to the end of its flatbuffer (at least its headers)
  uint64_t file_size = 0;
};

// The file's first bytes up to the end of its flatbuffer, as `flatbuffer_end` (of the first bytes) says; nothing after.
template <typename End>
Head read_head(const std::string& path, int64_t header_size, End flatbuffer_end) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileFault("cannot be read");
  Head head;
  head.data.resize(8 + header_size);
  in.read(reinterpret_cast<char*>(head.data.data()), static_cast<std::streamsize>(head.data.size()));
  head.data.resize(static_cast<size_t>(in.gcount()));
  in.clear();
  in.seekg(0, std::ios::end);
  head.file_size = static_cast<uint64_t>(in.tellg());
  if (head.data.size() < static_cast<size_t>(8 + header_size)) return head;
  const uint64_t end = std::min<uint64_t>(flatbuffer_end(head.data), head.file_size);
  if (end <= head.data.size()) return head;
  head.data.resize(static_cast<size_t>(end));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(head.data.data()), static_cast<std::streamsize>(end));
  if (static_cast<uint64_t>(in.gcount()) != end) throw FileFault("changed while it was read");
  return head;
}

// The file identifier (bytes 4-7) and the extended header's magic and length, where both files' headers keep them.
static_assert(fs::kProgramMagicAt == fs::kFlatTensorMagicAt && fs::kProgramLengthAt == fs::kFlatTensorLengthAt);
void check_identifier_and_header(const std::vector<uint8_t>& data, int64_t header_size, const char* identifier,
                                 const char* magic, const std::string& what) {
  if (data.size() < static_cast<size_t>(8 + header_size) || std::memcmp(data.data() + 4, identifier, 4) != 0)
    throw FileFault("not " + what + " (no " + identifier + " identifier)");
  if (std::memcmp(data.data() + fs::kProgramMagicAt, magic, 4) != 0 ||
      little_endian<uint32_t>(data, fs::kProgramLengthAt) < header_size)
    throw FileFault("its extended header is damaged");
}

// flatbuffer_files.py's check_flat_tensor, on a .ptd file.
void check_flat_tensor_file(const std::string& path) {
  Head head = read_head(path, fs::kFlatTensorHeaderSize, [](const std::vector<uint8_t>& data) {
    const uint64_t offset = little_endian<uint64_t>(data, fs::kFlatTensorFlatbufferOffsetAt);
    const uint64_t size = little_endian<uint64_t>(data, fs::kFlatTensorFlatbufferSizeAt);
    return offset > UINT64_MAX - size ? UINT64_MAX : offset + size;
  });
  const std::vector<uint8_t>& data = head.data;
  check_identifier_and_header(data, fs::kFlatTensorHeaderSize, fs::kFlatTensorIdentifier, fs::kFlatTensorHeaderMagic,
                              "a FlatTensor file");
  const uint64_t offset = little_endian<uint64_t>(data, fs::kFlatTensorFlatbufferOffsetAt);
  const uint64_t size = little_endian<uint64_t>(data, fs::kFlatTensorFlatbufferSizeAt);
  const uint64_t segment_base = little_endian<uint64_t>(data, fs::kFlatTensorSegmentBaseAt);
  const uint64_t segment_size = little_endian<uint64_t>(data, fs::kFlatTensorSegmentSizeAt);
  const uint64_t limit = std::min<uint64_t>(segment_size ? segment_base : head.file_size, data.size());
  if (offset > limit || size > limit - offset)
    throw FileFault("its flatbuffer runs past " + std::to_string(limit));
  if (segment_size && (segment_base > head.file_size || head.file_size - segment_base != segment_size))
    throw FileFault("its segment data is not the end of the file (" + std::to_string(head.file_size) + ")");
  const Buffer buffer(data, static_cast<int64_t>(offset + size));
  const Present root = table(buffer, buffer.target(0, "the root offset"), fs::kFlatTensor, "FlatTensor");
  const auto sizes = check_segments(buffer, vector_of_tables(buffer, root, fs::kFlatTensorSegments), segment_size);
  check_references(buffer, vector_of_tables(buffer, root, fs::kFlatTensorNamedData), fs::kNamedData,
                   fs::kNamedDataSegment, sizes, "named data");
}

// flatbuffer_files.py's check_program, on a .pte file; `external_data`: a weights file is loaded with it.
void check_program_file(const std::string& path, bool external_data) {
  Head head = read_head(path, fs::kProgramHeaderSize, [](const std::vector<uint8_t>& data) {
    return little_endian<uint64_t>(data, fs::kProgramProgramSizeAt);
  });
  const std::vector<uint8_t>& data = head.data;
  check_identifier_and_header(data, fs::kProgramHeaderSize, fs::kProgramIdentifier, fs::kProgramHeaderMagic,
                              "an ExecuTorch program");
  const uint64_t program_size = little_endian<uint64_t>(data, fs::kProgramProgramSizeAt);
  const uint64_t segment_base = little_endian<uint64_t>(data, fs::kProgramSegmentBaseAt);
  const uint64_t segment_size = little_endian<uint64_t>(data, fs::kProgramSegmentSizeAt);
  if (program_size < static_cast<uint64_t>(16 + fs::kProgramHeaderSize) ||
      program_size > std::min<uint64_t>(data.size(), head.file_size))
    throw FileFault("its program size " + std::to_string(program_size) + " does not fit the file");
  if (segment_size && (segment_base < program_size || segment_base > head.file_size ||
                       head.file_size - segment_base != segment_size))
    throw FileFault("its segment data is not the end of the file (" + std::to_string(head.file_size) + ")");
  const Buffer buffer(data, static_cast<int64_t>(program_size));
  const Present root = table(buffer, buffer.target(0, "the root offset"), fs::kProgram, "Program");
  if (!root.count(fs::kProgramNamedDataField) && !external_data)
    throw FileFault("it has no named data, and no weights file comes with it: its delegates' weights are nowhere");
  const auto sizes = check_segments(buffer, vector_of_tables(buffer, root, fs::kProgramSegments), segment_size);
  check_references(buffer, vector_of_tables(buffer, root, fs::kProgramMutableDataSegments), fs::kSubsegmentOffsets,
                   fs::kSubsegmentOffsetsSegment, sizes, "mutable data");
  check_references(buffer, vector_of_tables(buffer, root, fs::kProgramNamedDataField), fs::kProgramNamedData,
                   fs::kProgramNamedDataSegment, sizes, "named data");
}

}  // namespace flatbuffer_walk

void check_graph_file(const std::string& path, bool external_data) {
  auto ends_with = [&](const char* suffix) {
    const size_t n = std::strlen(suffix);
    return path.size() >= n && path.compare(path.size() - n, n, suffix) == 0;
  };
  if (ends_with(".pte")) flatbuffer_walk::check_program_file(path, external_data);
  else if (ends_with(".ptd")) flatbuffer_walk::check_flat_tensor_file(path);
}

}  // namespace mobile_moe::library
