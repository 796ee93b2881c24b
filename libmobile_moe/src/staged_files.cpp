// staged_files.h: staged names, who left them, and what writes them.
#include "staged_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

namespace mobile_moe::library {

// This host's short name (up to its first dot).
static std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "unknown";
  std::string host = name;
  return host.substr(0, host.find('.'));
}

std::string staged_name(const std::string& target) {
  static std::atomic<uint32_t> made{0};
  char sequence[16];
  std::snprintf(sequence, sizeof sequence, "%08x", made.fetch_add(1));
  return target + ".tmp-" + std::to_string(getpid()) + "-" + sequence + "@" + host_name();
}

std::string longest_staged_suffix() {
  return ".tmp-" + std::string(10, '9') + "-" + std::string(8, 'f') + "@" + host_name();
}

// Whether `name`, staged (".tmp-" at `at`), was left by a process that is gone: on this host, a pid that no longer
// runs; on another, a file untouched for a day. False for a name that is not staged_name's.
static bool left_by_gone_process(const std::string& dir, const std::string& name, size_t at) {
  char* end = nullptr;
  const long pid = std::strtol(name.c_str() + at + 5, &end, 10);
  if (pid <= 0) return false;
  if (*end == '-') {  // the count; staged files of older versions have none
    const char* sequence = end + 1;
    std::strtoul(sequence, &end, 16);
    if (end == sequence) return false;
  }
  if (*end != '@' && *end != '\0') return false;
  const std::string rest = *end == '@' ? end + 1 : "";
  const std::string host = rest.substr(0, rest.find('.'));
  if (host.empty() || host == host_name()) return kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
  struct stat info {};
  return stat((dir + "/" + name).c_str(), &info) == 0 && info.st_mtime < time(nullptr) - 24 * 3600;
}

std::string write_file(const std::string& path, const std::string& text) {
  const int out = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0) return std::strerror(errno);
  int error = 0;
  for (size_t done = 0; error == 0 && done < text.size();) {
    const ssize_t wrote = write(out, text.data() + done, text.size() - done);
    if (wrote > 0) done += static_cast<size_t>(wrote);
    else if (wrote == 0 || errno != EINTR) error = wrote == 0 ? EIO : errno;
  }
  if (close(out) != 0 && error == 0) error = errno;
  if (error == 0) return "";
  std::remove(path.c_str());
  return std::strerror(error);
}

void remove_files_left(const std::string& dir, const std::function<size_t(const std::string&)>& ours) {
  DIR* folder = opendir(dir.c_str());
  if (folder == nullptr) return;
  std::vector<std::string> left;
  while (const dirent* item = readdir(folder)) {
    const std::string name = item->d_name;
    const size_t at = ours(name);
    if (at != std::string::npos && left_by_gone_process(dir, name, at)) left.push_back(dir + "/" + name);
  }
  closedir(folder);
  for (const auto& path : left) std::remove(path.c_str());
}

}  // namespace mobile_moe::library
