// An ExecuTorch file checked before ExecuTorch reads it (part of libmobile_moe): the runner's side of
// mobile_moe/export/flatbuffer_files.py, which says why (ExecuTorch does not verify a .ptd at all, and reads some table
// entries of a verified .pte without asking whether they are there: a zeroed named_data crashed the runner). What is
// walked, and what must be there, is flatbuffer_schema.h, generated from that module; flatbuffer_check.cpp is the same
// walk step for step, and tests/export/test_flatbuffer_files.py gives both walks every damaged file of its fuzzing and
// expects the same verdicts. check_graph_file() throws FileFault naming the first fault.
#pragma once

#include <stdexcept>
#include <string>

namespace mobile_moe::library {

struct FileFault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// flatbuffer_files.py's check_graph_file: a .pte or .ptd by its suffix; other files are their runtimes' to check.
void check_graph_file(const std::string& path, bool external_data);

}  // namespace mobile_moe::library
