// file_identity.h: a file's identity from stat, and the one place that reads its times.
#include "file_identity.h"

#include <sys/stat.h>

#include <cstdint>
#include <string>

namespace mobile_moe::library {

const struct timespec& modified_time(const struct stat& info) {
#if defined(__APPLE__)
  return info.st_mtimespec;
#else
  return info.st_mtim;
#endif
}

const struct timespec& changed_time(const struct stat& info) {
#if defined(__APPLE__)
  return info.st_ctimespec;
#else
  return info.st_ctim;
#endif
}

bool FileIdentity::operator==(const FileIdentity& other) const {
  return device == other.device && inode == other.inode && size == other.size &&
         modified_ns == other.modified_ns && changed_ns == other.changed_ns;
}

std::string FileIdentity::text() const {
  return std::to_string(device) + " " + std::to_string(inode) + " " + std::to_string(size) + " " +
         std::to_string(modified_ns) + " " + std::to_string(changed_ns);
}

int64_t nanoseconds(const struct timespec& time) {
  return static_cast<int64_t>(time.tv_sec) * 1000000000 + static_cast<int64_t>(time.tv_nsec);
}

FileIdentity identify(const struct stat& info) {
  return {static_cast<uint64_t>(info.st_dev), static_cast<uint64_t>(info.st_ino), static_cast<int64_t>(info.st_size),
          nanoseconds(modified_time(info)), nanoseconds(changed_time(info))};
}

FileIdentity identify(const std::string& path) {
  struct stat info {};
  if (stat(path.c_str(), &info) != 0) return {};
  return identify(info);
}

}  // namespace mobile_moe::library
