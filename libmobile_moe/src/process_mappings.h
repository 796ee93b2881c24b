// Where this process maps a file, and how much of it is resident: the expert cache's parked experts
// (graphs.h parked_mappings) dropped their packed weights' pages, and mm_get_memory_stats says how many came back.
//
// Linux and Android expose these under /proc/self; elsewhere the readers return -1 / an empty list, so a number is
// never made up.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
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
std::vector<Mapping> mappings_of_file(dev_t device, ino_t inode);

// The bytes of these mappings that are resident in this process (their Rss lines in /proc/self/smaps); -1 where
// /proc is absent.
int64_t resident_bytes(const std::vector<Mapping>& mappings);

}  // namespace mobile_moe::stats
