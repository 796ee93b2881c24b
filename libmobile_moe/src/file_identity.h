// What a file is on disk, as far as stat tells without reading it: device, inode, size, modification and
// status-change times. Any write to a file changes its status-change time (the kernel sets it; no call sets it back),
// and a file replaced by a rename is another inode, so the same identity means the same bytes in practice. The one
// place that reads the times: Apple's stat names them st_mtimespec / st_ctimespec, Linux's (Android's) st_mtim /
// st_ctim.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <string>

namespace mobile_moe::library {

inline const struct timespec& modified_time(const struct stat& info) {
#if defined(__APPLE__)
  return info.st_mtimespec;
#else
  return info.st_mtim;
#endif
}

inline const struct timespec& changed_time(const struct stat& info) {
#if defined(__APPLE__)
  return info.st_ctimespec;
#else
  return info.st_ctim;
#endif
}

struct FileIdentity {
  uint64_t device = 0, inode = 0;
  int64_t size = -1, modified_ns = 0, changed_ns = 0;

  bool known() const { return size >= 0; }
  bool operator==(const FileIdentity& other) const {
    return device == other.device && inode == other.inode && size == other.size &&
           modified_ns == other.modified_ns && changed_ns == other.changed_ns;
  }
  bool operator!=(const FileIdentity& other) const { return !(*this == other); }
  std::string text() const {
    return std::to_string(device) + " " + std::to_string(inode) + " " + std::to_string(size) + " " +
           std::to_string(modified_ns) + " " + std::to_string(changed_ns);
  }
};

inline int64_t nanoseconds(const struct timespec& time) {
  return static_cast<int64_t>(time.tv_sec) * 1000000000 + static_cast<int64_t>(time.tv_nsec);
}

inline FileIdentity identify(const struct stat& info) {
  return {static_cast<uint64_t>(info.st_dev), static_cast<uint64_t>(info.st_ino), static_cast<int64_t>(info.st_size),
          nanoseconds(modified_time(info)), nanoseconds(changed_time(info))};
}

// The identity of `path` now; unknown (size -1) where it cannot be stat'ed.
inline FileIdentity identify(const std::string& path) {
  struct stat info {};
  if (stat(path.c_str(), &info) != 0) return {};
  return identify(info);
}

}  // namespace mobile_moe::library
