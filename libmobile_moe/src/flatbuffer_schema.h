// Generated from mobile_moe/export/flatbuffer_files.py, the one description of the ExecuTorch files we
// accept, by
//   python -m mobile_moe.export.flatbuffer_files --cpp-header > libmobile_moe/src/flatbuffer_schema.h
// Do not edit: change flatbuffer_files.py and regenerate (tests/test_docs.py compares the two).
#pragma once

#include <cstdint>

namespace mobile_moe::library::flatbuffer_schema {

constexpr int64_t kMaxEntries = 1048576;  // vector lengths
constexpr int64_t kMaxTables = 1048576;  // tables one walk visits
constexpr uint64_t kMaxSegmentPadding = 4096;  // between segments, and after the last

// A table field's kind: a scalar of `size` bytes, a string, a table, a vector of scalars of `size` bytes
// or a vector of tables; `table` indexes kTables (-1: none).
enum class Kind { Scalar, String, Table, Scalars, Tables };
struct Field {
  int index;
  Kind kind;
  int size;
  int table;
};
struct Table {
  const char* name;
  const Field* fields;
  int num_fields;
  const int* required;  // the fields ExecuTorch reads without asking whether they are there
  int num_required;
};

inline constexpr Field kDataSegmentFields[] = {{0, Kind::Scalar, 8, -1}, {1, Kind::Scalar, 8, -1}};
inline constexpr int kDataSegmentRequired[] = {-1};
inline constexpr Field kTensorLayoutFields[] = {{0, Kind::Scalar, 1, -1}, {1, Kind::Scalars, 4, -1}, {2, Kind::Scalars, 1, -1}};
inline constexpr int kTensorLayoutRequired[] = {-1};
inline constexpr Field kNamedDataFields[] = {{0, Kind::String, 4, -1}, {1, Kind::Scalar, 4, -1}, {2, Kind::Table, 4, 1}};
inline constexpr int kNamedDataRequired[] = {0};
inline constexpr Field kFlatTensorFields[] = {{0, Kind::Scalar, 4, -1}, {1, Kind::Tables, 4, 0}, {2, Kind::Tables, 4, 2}};
inline constexpr int kFlatTensorRequired[] = {-1};
inline constexpr Field kOperatorFields[] = {{0, Kind::String, 4, -1}, {1, Kind::String, 4, -1}};
inline constexpr int kOperatorRequired[] = {-1};
inline constexpr Field kCompileSpecFields[] = {{0, Kind::String, 4, -1}, {1, Kind::Scalars, 1, -1}};
inline constexpr int kCompileSpecRequired[] = {-1};
inline constexpr Field kDelegateDataFields[] = {{0, Kind::Scalar, 1, -1}, {1, Kind::Scalar, 4, -1}};
inline constexpr int kDelegateDataRequired[] = {-1};
inline constexpr Field kBackendDelegateFields[] = {{0, Kind::String, 4, -1}, {1, Kind::Table, 4, 6}, {2, Kind::Tables, 4, 5}};
inline constexpr int kBackendDelegateRequired[] = {-1};
inline constexpr Field kContainerMetadataFields[] = {{0, Kind::String, 4, -1}, {1, Kind::String, 4, -1}};
inline constexpr int kContainerMetadataRequired[] = {-1};
inline constexpr Field kAnyTableFields[] = {{-1, Kind::Scalar, 0, -1}};
inline constexpr int kAnyTableRequired[] = {-1};
inline constexpr Field kInstructionFields[] = {{0, Kind::Scalar, 1, -1}, {1, Kind::Table, 4, 9}};
inline constexpr int kInstructionRequired[] = {0, 1};
inline constexpr Field kChainFields[] = {{0, Kind::Scalars, 4, -1}, {1, Kind::Scalars, 4, -1}, {2, Kind::Tables, 4, 10}};
inline constexpr int kChainRequired[] = {0, 1, 2};
inline constexpr Field kExecutionPlanFields[] = {{0, Kind::String, 4, -1}, {1, Kind::Table, 4, 8}, {2, Kind::Tables, 4, 9}, {3, Kind::Scalars, 4, -1}, {4, Kind::Scalars, 4, -1}, {5, Kind::Tables, 4, 11}, {6, Kind::Tables, 4, 4}, {7, Kind::Tables, 4, 7}, {8, Kind::Scalars, 8, -1}};
inline constexpr int kExecutionPlanRequired[] = {0, 2, 3, 4, 5, 6, 7, 8};
inline constexpr Field kSubsegmentOffsetsFields[] = {{0, Kind::Scalar, 4, -1}, {1, Kind::Scalars, 8, -1}};
inline constexpr int kSubsegmentOffsetsRequired[] = {-1};
inline constexpr Field kProgramNamedDataFields[] = {{0, Kind::String, 4, -1}, {1, Kind::Scalar, 4, -1}};
inline constexpr int kProgramNamedDataRequired[] = {-1};
inline constexpr Field kProgramFields[] = {{0, Kind::Scalar, 4, -1}, {1, Kind::Tables, 4, 12}, {4, Kind::Tables, 4, 0}, {5, Kind::Table, 4, 13}, {6, Kind::Tables, 4, 13}, {7, Kind::Tables, 4, 14}};
inline constexpr int kProgramRequired[] = {1};

inline constexpr Table kTables[] = {
  {"DataSegment", kDataSegmentFields, 2, kDataSegmentRequired, 0},
  {"TensorLayout", kTensorLayoutFields, 3, kTensorLayoutRequired, 0},
  {"NamedData", kNamedDataFields, 3, kNamedDataRequired, 1},
  {"FlatTensor", kFlatTensorFields, 3, kFlatTensorRequired, 0},
  {"Operator", kOperatorFields, 2, kOperatorRequired, 0},
  {"CompileSpec", kCompileSpecFields, 2, kCompileSpecRequired, 0},
  {"DelegateData", kDelegateDataFields, 2, kDelegateDataRequired, 0},
  {"BackendDelegate", kBackendDelegateFields, 3, kBackendDelegateRequired, 0},
  {"ContainerMetadata", kContainerMetadataFields, 2, kContainerMetadataRequired, 0},
  {"AnyTable", kAnyTableFields, 0, kAnyTableRequired, 0},
  {"Instruction", kInstructionFields, 2, kInstructionRequired, 2},
  {"Chain", kChainFields, 3, kChainRequired, 3},
  {"ExecutionPlan", kExecutionPlanFields, 9, kExecutionPlanRequired, 8},
  {"SubsegmentOffsets", kSubsegmentOffsetsFields, 2, kSubsegmentOffsetsRequired, 0},
  {"ProgramNamedData", kProgramNamedDataFields, 2, kProgramNamedDataRequired, 0},
  {"Program", kProgramFields, 6, kProgramRequired, 1},
};
constexpr int kDataSegment = 0;
constexpr int kTensorLayout = 1;
constexpr int kNamedData = 2;
constexpr int kFlatTensor = 3;
constexpr int kOperator = 4;
constexpr int kCompileSpec = 5;
constexpr int kDelegateData = 6;
constexpr int kBackendDelegate = 7;
constexpr int kContainerMetadata = 8;
constexpr int kAnyTable = 9;
constexpr int kInstruction = 10;
constexpr int kChain = 11;
constexpr int kExecutionPlan = 12;
constexpr int kSubsegmentOffsets = 13;
constexpr int kProgramNamedData = 14;
constexpr int kProgram = 15;

// The extended headers (at byte 8) and the file identifiers (at byte 4).
inline constexpr char kProgramIdentifier[] = "ET12";
inline constexpr char kProgramHeaderMagic[] = "eh00";
constexpr int64_t kProgramHeaderSize = 32;
constexpr int64_t kProgramMagicAt = 8;
constexpr int64_t kProgramLengthAt = 12;
constexpr int64_t kProgramProgramSizeAt = 16;
constexpr int64_t kProgramSegmentBaseAt = 24;
constexpr int64_t kProgramSegmentSizeAt = 32;
inline constexpr char kFlatTensorIdentifier[] = "FT01";
inline constexpr char kFlatTensorHeaderMagic[] = "FH01";
constexpr int64_t kFlatTensorHeaderSize = 40;
constexpr int64_t kFlatTensorMagicAt = 8;
constexpr int64_t kFlatTensorLengthAt = 12;
constexpr int64_t kFlatTensorFlatbufferOffsetAt = 16;
constexpr int64_t kFlatTensorFlatbufferSizeAt = 24;
constexpr int64_t kFlatTensorSegmentBaseAt = 32;
constexpr int64_t kFlatTensorSegmentSizeAt = 40;

// The fields the file-level checks read.
constexpr int kSegmentOffset = 0;
constexpr int kSegmentSize = 1;
constexpr int kFlatTensorSegments = 1;
constexpr int kFlatTensorNamedData = 2;
constexpr int kNamedDataSegment = 1;
constexpr int kProgramSegments = 4;
constexpr int kProgramMutableDataSegments = 6;
constexpr int kProgramNamedDataField = 7;
constexpr int kSubsegmentOffsetsSegment = 0;
constexpr int kProgramNamedDataSegment = 1;

}  // namespace mobile_moe::library::flatbuffer_schema
