// SHA-256 (FIPS 180-4), self-contained: no dependency, so the runner still cross-compiles with nothing but the NDK.
//
// The runner checks every graph file's sha256 against the manifest before it loads any graph: a bundle can be run by
// hand on a phone, where no Python checked it. tests/device_bench/test_native_faults.py compares this with hashlib.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mobile_moe::sha256 {

constexpr size_t kHexDigits = 64;  // a digest written out: 32 bytes, two hex digits each

class Hasher {
 public:
  Hasher() { reset(); }

  void reset();

  void update(const void* data, size_t size);

  // The digest as kHexDigits lowercase hex digits (the manifest's form). The hasher must be reset before reuse.
  std::string hex_digest();

 private:
  uint32_t state_[8];
  uint64_t length_;
  uint8_t block_[64];
  size_t used_;

  static uint32_t rotr(uint32_t x, int n);

  void compress(const uint8_t* chunk);
};

std::string hex_digest(const void* data, size_t size);

// A file's sha256 and size, read in chunks; false when it cannot be read to the end.
bool file_digest(const std::string& path, std::string* digest, uint64_t* size);

}  // namespace mobile_moe::sha256
