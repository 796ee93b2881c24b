// What the OS says about the runner's process: resident and proportional memory, and which files it holds open.
//
// Linux and Android expose these under /proc/self; elsewhere the readers return -1 / an empty list, and the JSON
// carries null, so a number is never made up.
#pragma once

#include <dirent.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace mobile_moe::stats {

// A /proc file's text; empty when it cannot be read.
inline std::string read_proc(const char* path) {
  std::ifstream file(path);
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

// A "Key:   1234 kB" line of a /proc file's text, in bytes; -1 when the key is absent.
inline int64_t kb_field(const std::string& text, const std::string& key) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.compare(0, key.size() + 1, key + ":") == 0) {
      std::istringstream fields(line.substr(key.size() + 1));
      int64_t kilobytes = -1;
      fields >> kilobytes;
      return kilobytes < 0 ? -1 : kilobytes * 1024;
    }
  }
  return -1;
}

struct Memory {
  int64_t rss_bytes;       // VmRSS: resident now
  int64_t peak_rss_bytes;  // VmHWM: the high-water mark of RSS since the process started
  int64_t pss_bytes;       // Pss from smaps_rollup: shared pages divided among the processes sharing them
};

inline Memory memory_now() {
  // VmRSS and VmHWM from ONE read: the kernel reports the high-water mark as at least the RSS it prints beside it,
  // but RSS reclaimed between two reads could leave a second read's VmHWM below the first read's VmRSS.
  const std::string status = read_proc("/proc/self/status");
  return Memory{
      kb_field(status, "VmRSS"),
      kb_field(status, "VmHWM"),
      kb_field(read_proc("/proc/self/smaps_rollup"), "Pss"),
  };
}

// Files under `directory` that this process has open right now, by reading /proc/self/fd. An ExecuTorch data loader
// keeps its graph file open while the program is loaded, so this is the OS's own list of graphs held.
inline std::vector<std::string> open_files_under(const std::string& directory) {
  std::vector<std::string> found;
  DIR* fds = opendir("/proc/self/fd");
  if (fds == nullptr) return found;
  while (dirent* entry = readdir(fds)) {
    std::string link = std::string("/proc/self/fd/") + entry->d_name;
    char target[4096];
    ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    std::string path(target);
    if (path.compare(0, directory.size() + 1, directory + "/") == 0) found.push_back(path.substr(directory.size() + 1));
  }
  closedir(fds);
  return found;
}

}  // namespace mobile_moe::stats
