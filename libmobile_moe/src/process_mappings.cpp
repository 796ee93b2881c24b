// process_mappings.h: this process's mappings of a file, and their resident bytes, from /proc/self.
#include "process_mappings.h"

#include <sys/sysmacros.h>
#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace mobile_moe::stats {

std::vector<Mapping> mappings_of_file(dev_t device, ino_t inode) {
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

int64_t resident_bytes(const std::vector<Mapping>& mappings) {
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
