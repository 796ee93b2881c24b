// The library's own checks, run on files one at a time so the tests can compare them with the reference
// implementations: a white-box tool of the test suite, not a client (it includes the library's private headers and
// links the library's code, CMakeLists.txt's mobile_moe_objects).
//
//   mobile_moe_internal_checks --sha256 FILE...   "DIGEST  FILE" per file (sha256sum's format), sha256.h's digest
//   mobile_moe_internal_checks --xxh64 FILE...    the same with packed_cache.cpp's XXH64
//   mobile_moe_internal_checks --check [--external-data] FILE...
//       "ok  FILE" or "refused  FILE: why" per file: the check a bundle's files get before any is loaded
//       (flatbuffer_check.h), the tests giving it every file they give mobile_moe/export/flatbuffer_files.py;
//       --external-data: programs that load a weights file with them
//
// Exit 2 with one line on stderr for bad usage or an unreadable file.
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "errors.h"
#include "flatbuffer_check.h"
#include "packed_cache.h"
#include "sha256.h"

namespace {

using namespace mobile_moe::library;

const char* kUsage = "usage: mobile_moe_internal_checks --sha256|--xxh64 FILE... | --check [--external-data] FILE...";

std::string one_line(std::string text) {
  for (char& c : text)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  return text;
}

int print_digests(int argc, char** argv) {
  const std::string algorithm = argv[1];
  if (argc < 3) throw UsageError(algorithm + " needs at least one file");
  for (int i = 2; i < argc; ++i) {
    std::string digest;
    uint64_t size = 0;
    bool read = algorithm == "--sha256" ? mobile_moe::sha256::file_digest(argv[i], &digest, &size)
                                        : !(digest = file_xxh64(argv[i], &size)).empty();
    if (!read) throw UsageError(std::string("cannot read ") + argv[i]);
    std::printf("%s  %s\n", digest.c_str(), argv[i]);
  }
  return 0;
}

int print_checks(int argc, char** argv) {
  int first = 2;
  const bool external_data = argc > 2 && std::string(argv[2]) == "--external-data";
  if (external_data) ++first;
  if (argc <= first) throw UsageError("--check needs at least one file");
  for (int i = first; i < argc; ++i) {
    try {
      check_graph_file(argv[i], external_data);
      std::printf("ok  %s\n", argv[i]);
    } catch (const FileFault& fault) {
      std::printf("refused  %s: %s\n", argv[i], one_line(fault.what()).c_str());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc >= 2 ? argv[1] : "";
    if (mode == "--sha256" || mode == "--xxh64") return print_digests(argc, argv);
    if (mode == "--check") return print_checks(argc, argv);
    throw UsageError(kUsage);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "mobile_moe_internal_checks: %s\n", one_line(error.what()).c_str());
    return 2;
  }
}
