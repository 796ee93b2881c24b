// What the OS says about this process: resident and proportional memory, which files it holds open, and where it maps
// a file.
//
// Linux and Android expose these under /proc/self; elsewhere the readers return -1 / an empty list, and the JSON
// carries null, so a number is never made up.
#pragma once

#include <dirent.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <set>
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

// One mapping of this process: where it starts, how many bytes it spans, and its permissions' write and share bits.
struct Mapping {
  uintptr_t begin = 0;
  size_t size = 0;
  bool writable = false, shared = false;
};

// This process's mappings of the file with this device and inode number, from /proc/self/maps (the one way to find a
// mapping that a library made of a file it opened itself); empty where /proc is absent.
inline std::vector<Mapping> mappings_of_file(dev_t device, ino_t inode) {
  std::vector<Mapping> found;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {  // "begin-end perms offset major:minor inode path"
    unsigned long begin = 0, end = 0, offset = 0, number = 0;
    unsigned major = 0, minor = 0;
    char perms[8];
    if (std::sscanf(line.c_str(), "%lx-%lx %7s %lx %x:%x %lu", &begin, &end, perms, &offset, &major, &minor,
                    &number) == 7 &&
        number == inode && makedev(major, minor) == device)
      found.push_back({begin, end - begin, perms[1] == 'w', perms[3] == 's'});
  }
  return found;
}

// The bytes of these mappings that are resident in this process (their Rss lines in /proc/self/smaps); -1 where
// /proc is absent.
inline int64_t resident_bytes(const std::vector<Mapping>& mappings) {
  std::ifstream smaps("/proc/self/smaps");
  if (!smaps) return -1;
  std::set<uintptr_t> wanted;
  for (const Mapping& mapping : mappings) wanted.insert(mapping.begin);
  int64_t bytes = 0;
  bool counting = false;
  std::string line;
  while (std::getline(smaps, line)) {
    unsigned long begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &begin, &end) == 2)  // a mapping's header line; its fields follow
      counting = wanted.count(begin) > 0;
    else if (counting && line.compare(0, 4, "Rss:") == 0)
      bytes += std::stoll(line.substr(4)) * 1024;
  }
  return bytes;
}

}  // namespace mobile_moe::stats
