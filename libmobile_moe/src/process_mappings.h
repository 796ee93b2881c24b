// Where this process maps a file, and how much of it is resident: the expert cache's parked experts
// (graphs.h parked_mappings) dropped their packed weights' pages, and mm_get_memory_stats says how many came back.
//
// Linux and Android expose these under /proc/self; elsewhere the readers return -1 / an empty list, so a number is
// never made up.
#pragma once

#include <sys/sysmacros.h>
#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace mobile_moe::stats {

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
