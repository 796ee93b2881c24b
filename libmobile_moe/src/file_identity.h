// What a file is on disk, as far as stat tells without reading it: device, inode, size, modification and
// status-change times. Any write to a file changes its status-change time (the kernel sets it; no call sets it back),
// and a file replaced by a rename is another inode, so the same identity means the same bytes in practice. The one
// place that reads the times (file_identity.cpp): Apple's stat names them st_mtimespec / st_ctimespec, Linux's
// (Android's) st_mtim / st_ctim.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <ctime>
#include <string>

namespace mobile_moe::library {

const struct timespec& modified_time(const struct stat& info);
const struct timespec& changed_time(const struct stat& info);

struct FileIdentity {
  uint64_t device = 0, inode = 0;
  int64_t size = -1, modified_ns = 0, changed_ns = 0;

  bool known() const { return size >= 0; }
  bool operator==(const FileIdentity& other) const;
  bool operator!=(const FileIdentity& other) const { return !(*this == other); }
  std::string text() const;
};

int64_t nanoseconds(const struct timespec& time);

FileIdentity identify(const struct stat& info);

// The identity of `path` now; unknown (size -1) where it cannot be stat'ed.
FileIdentity identify(const std::string& path);

}  // namespace mobile_moe::library
