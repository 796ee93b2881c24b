// mapped_file.h: a whole file mapped read-only, shared and counted.
#include "mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "file_identity.h"

namespace mobile_moe::library {

std::shared_ptr<const MappedFile> MappedFile::open(const std::string& path, int advice) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nullptr;
  struct stat info {};
  void* data = nullptr;
  if (fstat(fd, &info) != 0 ||
      (info.st_size > 0 &&
       (data = mmap(nullptr, static_cast<size_t>(info.st_size), PROT_READ, MAP_PRIVATE, fd, 0)) == MAP_FAILED)) {
    const int error = errno;
    ::close(fd);
    errno = error;
    return nullptr;
  }
  if (data != nullptr && advice != 0) madvise(data, static_cast<size_t>(info.st_size), advice);
  auto file = std::shared_ptr<MappedFile>(new MappedFile(fd, data, static_cast<size_t>(info.st_size)));
  file->identity_ = identify(info);
  return file;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) munmap(const_cast<void*>(data_), size_);
  ::close(fd_);
}

void MappedFile::drop_pages(const void* at, size_t length) const {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(at) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(at) + length) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace mobile_moe::library
