// A whole file mapped read-only, the one way libmobile_moe maps a file itself: the packed-weight cache's check and
// copy (packed_cache.cpp) and an expert's graph files (graph_loader.cpp, WholeFileDataLoader). Shared and counted: the
// mapping goes with the last holder, so a piece of it that ExecuTorch frees late never touches an address that is no
// longer ours.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <memory>
#include <string>

#include "file_identity.h"

// Transparent huge pages are Linux's (Android's): where madvise has no such advice (Apple's), none is given.
#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 0
#endif
#ifndef MADV_NOHUGEPAGE
#define MADV_NOHUGEPAGE 0
#endif

namespace mobile_moe::library {

class MappedFile {
 public:
  // The file mapped whole with `advice` (madvise; 0 for none: advice only, a kernel that refuses it changes nothing
  // read); an empty file maps to no bytes (data() null). nullptr when it cannot be opened, read or mapped (errno says
  // why). The descriptor stays open while the mapping lives: /proc/self/fd then lists the file as held.
  static std::shared_ptr<const MappedFile> open(const std::string& path, int advice = 0);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const unsigned char* data() const { return static_cast<const unsigned char*>(data_); }
  size_t size() const { return size_; }
  // The mapped file's identity (file_identity.h), read from the descriptor it was mapped from: what was mapped, even
  // where the path names another file since.
  const FileIdentity& identity() const { return identity_; }

  // Drop the whole pages inside [at, at + length) from this process (MADV_DONTNEED): the file's bytes stay in the
  // page cache, and a later read faults them back in, unchanged (the mapping is private and read-only, so there is
  // no private copy to lose).
  void drop_pages(const void* at, size_t length) const;

 private:
  MappedFile(int fd, void* data, size_t size) : fd_(fd), data_(data), size_(size) {}
  int fd_;
  const void* data_;
  size_t size_;
  FileIdentity identity_;
};

}  // namespace mobile_moe::library
