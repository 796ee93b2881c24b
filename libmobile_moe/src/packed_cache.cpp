// packed_cache.h: XNNPACK's packed weights kept on disk, one checked file per graph.
#include "packed_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <pwd.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "bundle_manifest.h"
#include "errors.h"
#include "file_identity.h"
#include "mapped_file.h"
#include "runtime_log.h"
#include "sha256.h"
#include "staged_files.h"

namespace mobile_moe::library {

// The CPU's feature flags (/proc/cpuinfo's first "flags" or "Features" line): XNNPACK picks its micro-kernels, and
// so the layout of packed weights, by them, and a cache folder in a shared home can serve machines of several kinds.
static std::string cpu_features() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line))
    if (line.rfind("flags", 0) == 0 || line.rfind("Features", 0) == 0) return line;
  return "";
}

// What a cache file's name depends on besides the graph: the ExecuTorch build (CMakeLists.txt passes its version),
// the machine and its CPU's features, and this file's own format (bump kPackedCacheFormat when the check file
// changes). Computed once per process: every load keys its graph with it, and reading /proc/cpuinfo on each one cost
// a switch 0.07 ms.
constexpr int kPackedCacheFormat = 1;
static const std::string& runtime_identity() {
#if defined(__aarch64__)
  const char* arch = "aarch64";
#elif defined(__x86_64__)
  const char* arch = "x86_64";
#else
  const char* arch = "other";
#endif
  static const std::string identity = std::string(MOBILE_MOE_RUNTIME_ID) + "/" + arch + "/" + cpu_features() +
                                      "/packed-cache-" + std::to_string(kPackedCacheFormat);
  return identity;
}

// XXH64 (github.com/Cyan4973/xxHash, xxhash.h's reference algorithm), seed 0, fed in pieces: fast enough to check a
// packed expert on every first use (GB/s, where sha256.h is ~0.2 GB/s); it guards against damage, not against an
// attacker. Every piece but the last is a whole number of 32-byte stripes (file_xxh64's windows are).
class Xxh64 {
 public:
  static constexpr size_t kStripe = 32;

  void update(const unsigned char* data, size_t length) {
    total_ += length;
    for (; length >= kStripe; data += kStripe, length -= kStripe) stripe(data);
    std::memcpy(buffer_, data, length);  // the last piece's tail: digest() hashes it
    buffered_ = length;
  }

  uint64_t digest() const {
    uint64_t h = P5;
    if (total_ >= kStripe) {
      h = rotl(lanes_[0], 1) + rotl(lanes_[1], 7) + rotl(lanes_[2], 12) + rotl(lanes_[3], 18);
      for (uint64_t lane : lanes_) h = (h ^ round(0, lane)) * P1 + P4;
    }
    h += total_;
    const unsigned char* p = buffer_;
    const unsigned char* end = buffer_ + buffered_;
    for (; p + 8 <= end; p += 8) h = rotl(h ^ round(0, read64(p)), 27) * P1 + P4;
    if (p + 4 <= end) {
      h = rotl(h ^ (read32(p) * P1), 23) * P2 + P3;
      p += 4;
    }
    for (; p < end; ++p) h = rotl(h ^ (*p * P5), 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
  }

 private:
  static constexpr uint64_t P1 = 11400714785074694791ULL, P2 = 14029467366897019727ULL, P3 = 1609587929392839161ULL;
  static constexpr uint64_t P4 = 9650029242287828579ULL, P5 = 2870177450012600261ULL;
  static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  static uint64_t read64(const unsigned char* p) {  // little-endian hosts
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
  }
  static uint64_t read32(const unsigned char* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  static uint64_t round(uint64_t acc, uint64_t lane) { return rotl(acc + lane * P2, 31) * P1; }
  void stripe(const unsigned char* p) {
    for (int lane = 0; lane < 4; ++lane) lanes_[lane] = round(lanes_[lane], read64(p + 8 * lane));
  }

  uint64_t lanes_[4] = {P1 + P2, P2, 0, 0 - P1};
  unsigned char buffer_[kStripe] = {};
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

// The file is read one window at a time, each window a mapping of its own, unmapped before the next: a whole file's
// mapping would hold every page of it in the process while the check runs, beside the graphs already loaded, and an
// expert's check on its first load would be the split bundle's peak (benchmarks/split_memory.results.md). A published
// file is never truncated (a graph's file is replaced by rename), so no window reaches past its end. Each window is advised MADV_HUGEPAGE: where the file's
// pages are not in the page cache (the first use after a reboot, or after memory pressure took them), a kernel whose
// page cache takes large folios for the file's filesystem (Linux 6.18, ext4) reads them in as 2 MiB folios
// (mm/filemap.c, do_sync_mmap_readahead on a VM_HUGEPAGE mapping, whatever the mapping's size), and the backend's own
// mapping of the file (XNNWeightsCache.cpp load_packed_cache) then maps 2 MiB at a time. A switch maps its expert's
// packed weights on the first run and unmaps them at eviction, so this is its cost; read(2) would leave the folios to
// readahead's smaller ones (benchmarks/page_cache_folios.py measures both). Pages already cached stay as they are.
// Windows of 256 KiB: the most the check adds to the process, far below an expert's packed weights.
constexpr size_t kCheckWindow = 256 * 1024;  // benchmarks/page_cache_folios.py reads a file as this does
static_assert(kCheckWindow % Xxh64::kStripe == 0, "a window must hold whole stripes");

std::string file_xxh64(const std::string& path, uint64_t* size) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  struct stat info;
  bool readable = fstat(fd, &info) == 0 && S_ISREG(info.st_mode);
  Xxh64 hash;
  const uint64_t length = readable ? static_cast<uint64_t>(info.st_size) : 0;
  for (uint64_t at = 0; readable && at < length; at += kCheckWindow) {
    const size_t window_size = static_cast<size_t>(std::min<uint64_t>(kCheckWindow, length - at));
    void* window = mmap(nullptr, window_size, PROT_READ, MAP_PRIVATE, fd, static_cast<off_t>(at));
    readable = window != MAP_FAILED;
    if (!readable) break;
    madvise(window, window_size, MADV_HUGEPAGE);
    hash.update(static_cast<const unsigned char*>(window), window_size);
    munmap(window, window_size);
  }
  close(fd);
  if (!readable) return "";
  *size = length;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash.digest()));
  return hex;
}

// Copy `from` to a new file `to` (mode 0600, as the backend creates its files) in writes of up to 64 MiB; false, and
// no `to`, when that fails. Why copy a file the backend has just written: it wrote it through a mapping, a 4 KiB page
// at a time, so the page cache holds it in 4 KiB pages, which every later mapping of it maps and unmaps one by one;
// written in large writes, it is held in large folios where the filesystem's page cache takes them (as
// file_xxh64 says), mapped and unmapped many pages at a time (benchmarks/page_cache_folios.py). The source is written
// from its mapping as it faults in: an expert's 4.37 MB copy comes out mostly in large folios in 2 ms; filling the
// source's page tables first gave every page a large folio but took 12 ms (results file).
static bool copy_in_large_writes(const std::string& from, const std::string& to) {
  auto file = MappedFile::open(from);
  if (file == nullptr) return false;
  const int out = open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  bool copied = out >= 0;
  for (size_t done = 0; copied && done < file->size();) {
    const ssize_t wrote = write(out, file->data() + done, std::min<size_t>(file->size() - done, 64 << 20));
    copied = wrote > 0 || (wrote < 0 && errno == EINTR);
    if (wrote > 0) done += static_cast<size_t>(wrote);
  }
  if (out >= 0 && close(out) != 0) copied = false;
  if (!copied && out >= 0) std::remove(to.c_str());
  return copied;
}

bool make_folders(const std::string& dir) {
  for (size_t at = dir.find('/', 1);; at = dir.find('/', at + 1)) {
    const std::string part = dir.substr(0, at);
    if (!part.empty() && mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) return false;
    if (at == std::string::npos) return true;
  }
}

// XNNPACK takes a cache file's path as a backend option string, which holds at most 255 characters
// (runtime/backend/options.h kMaxOptionValueLength): a longer one would be cut silently and name another file.
constexpr size_t kMaxCachePath = 255;

// The longest path PackedCache hands the backend in `dir` (a scratch file's, staged by any process).
static size_t longest_cache_path(const std::string& dir) {
  return (dir + "/" + std::string(32, '0') + ".xnnpack" + longest_staged_suffix() + ".scratch").size();
}

std::string cache_path_too_long(const std::string& dir) {
  const size_t longest = longest_cache_path(dir);
  if (longest <= kMaxCachePath) return "";
  return "its path is too long for XNNPACK's cache path option (" + std::to_string(longest) + " of at most " +
         std::to_string(kMaxCachePath) + " characters with the file name)";
}
std::string unusable_cache_folder(const std::string& dir) {
  struct stat info {};
  if (const std::string why = cache_path_too_long(dir); !why.empty()) return why;
  if (stat(dir.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) return "not a directory";
  if (access(dir.c_str(), W_OK) != 0) return "not writable";
  return "";
}

std::string default_cache_dir(std::string* off_because) {
  auto env = [](const char* name) -> std::string {
    const char* value = std::getenv(name);
    return value != nullptr ? value : "";
  };
  std::string dir = env("MOBILE_MOE_WEIGHT_CACHE");
  if (dir.empty()) {
    std::string root = env("MOBILE_MOE_CACHE");
    const std::string xdg = env("XDG_CACHE_HOME");
    if (root.empty() && xdg.rfind('/', 0) == 0) root = xdg + "/mobile-moe";  // a relative one is ignored (XDG)
    std::string home = env("HOME");
    if (home.rfind('/', 0) != 0) {  // mobile_moe/utils/cache.py's home(): the password database's, where HOME is unset,
                                     // empty or relative
      // getpwuid_r: another thread of the app (another mm_open) may be reading the password database too
      passwd entry{}, *user = nullptr;
      std::vector<char> buffer(16384);
      if (getpwuid_r(getuid(), &entry, buffer.data(), buffer.size(), &user) == 0 && user != nullptr &&
          user->pw_dir != nullptr)
        home = user->pw_dir;
    }
    if (root.empty() && !home.empty()) root = home + "/.cache/mobile-moe";
    if (!root.empty()) dir = root + "/packed-weights";
  }
  std::string why = dir.empty() ? "none (no MOBILE_MOE_WEIGHT_CACHE, MOBILE_MOE_CACHE, XDG_CACHE_HOME or home)"
                                : cache_path_too_long(dir);
  if (why.empty() && !make_folders(dir)) why = std::string("cannot create it (") + std::strerror(errno) + ")";
  if (why.empty()) why = unusable_cache_folder(dir);
  if (why.empty()) return dir;
  const std::string said = "per-user folder " + (dir.empty() ? why : dir + ": " + why);
  library_log(MM_LOG_INFO, "packed-weight cache off (graphs are packed in memory): " + said +
                               "; an app may pass options.weight_cache_dir");
  if (off_because != nullptr) *off_because = said;
  return "";
}

const char* state_name(PackedCacheState state) {
  return state == PackedCacheState::Off ? "off" : state == PackedCacheState::Cold ? "cold" : "warm";
}

PackedCache::PackedCache(std::string dir, uint64_t limit)
    : dir_(std::move(dir)), limit_(limit) {
  if (const std::string why = unusable_cache_folder(dir_); !why.empty())
    throw UsageError("weight cache folder " + dir_ + ": " + why + "; pass a folder this process may write, with a " +
                     "shorter path (an app passes its cache folder), or none");
  remove_orphaned_stages();
}

PackedCacheEntry PackedCache::prepare(const Graph& graph) {
  if (!enabled()) return {};
  std::string graph_key = key(graph);
  PackedCacheEntry entry{file_for(graph_key), graph_key, PackedCacheState::Warm, "", graph.switched()};
  if (trusted(entry)) {
    touch(entry.path + ".check");  // recently used: the last to go when the directory is over its limit
    return entry;
  }
  if (!room_for(graph, graph_key)) return {};
  entry.published = entry.path;
  entry.path = staged(entry.published);
  entry.state = PackedCacheState::Cold;
  remove(entry.path);
  return entry;
}

PackedCacheEntry PackedCache::scratch(const Graph& graph) {
  std::string graph_key = key(graph);
  if (!room_for(graph, graph_key)) return {};
  PackedCacheEntry entry{staged(file_for(graph_key)) + ".scratch", graph_key, PackedCacheState::Cold, ""};
  remove(entry.path);
  return entry;
}

void PackedCache::discard(const PackedCacheEntry& entry) {
  if (entry.state != PackedCacheState::Off) remove(entry.path);
}

const char* PackedCache::record(const PackedCacheEntry& entry) {
  if (entry.state == PackedCacheState::Off) return "packed";
  auto seen = checked_.find(entry.path);
  if (entry.state == PackedCacheState::Warm && seen != checked_.end() && seen->second == identity(entry.path))
    return "mapped";
  const bool publish = !entry.published.empty();
  const std::string& target = publish ? entry.published : entry.path;
  // An expert's file is published as a copy in large writes (copy_in_large_writes says why), or, where the copy
  // cannot be written (a full disk), as the backend's file itself, like any other graph's; the check describes the
  // published bytes. The backend keeps its mapping of the file it wrote when its name goes.
  const std::string copy = entry.path + ".copy";
  const bool copied = publish && entry.switched && copy_in_large_writes(entry.path, copy);
  const std::string& to_publish = copied ? copy : entry.path;
  const std::string check = staged(target + ".check");
  auto give_up = [&]() {  // nothing published: what this process wrote for it goes (a scratch file stays)
    remove(check);
    if (publish) std::remove(entry.path.c_str());
    if (copied) std::remove(copy.c_str());
    return "packed";
  };
  uint64_t size = 0;
  const std::string digest = file_xxh64(to_publish, &size);
  if (digest.empty()) return give_up();  // the backend wrote no file (it packed on the heap)
  const std::string line = "mobile-moe packed cache " + std::to_string(kPackedCacheFormat) + " " + entry.key + " " +
                           std::to_string(size) + " " + digest + "\n";
  if (!write_file(check, line).empty()) return give_up();
  // A reader between the two renames sees a file and a check that do not match, which is a miss, never a wrong
  // answer.
  const std::string target_check = target + ".check";
  if (std::rename(to_publish.c_str(), target.c_str()) != 0 || std::rename(check.c_str(), target_check.c_str()) != 0)
    return give_up();
  if (copied) std::remove(entry.path.c_str());
  checked_[target] = identity(target);
  if (publish) keep_within_limit(target);
  return "packed";
}

uint64_t PackedCache::bytes_held() const {
  uint64_t total = 0;
  for (const auto& file : published_files()) total += file.size;
  return total;
}

PackedCache::Identity PackedCache::identity(const std::string& path) {
  struct stat info {};
  if (stat(path.c_str(), &info) != 0) return {};
  return {info.st_dev, info.st_ino, info.st_size, static_cast<int64_t>(modified_time(info).tv_sec),
          static_cast<int64_t>(modified_time(info).tv_nsec)};
}

std::string PackedCache::key(const Graph& graph) {
  std::string text = runtime_identity() + "\n" + graph.program.sha256 + "\n" + graph.weights.sha256;
  return sha256::hex_digest(text.data(), text.size()).substr(0, 32);
}

void PackedCache::remove(const std::string& path) {
  std::remove(path.c_str());
  std::remove((path + ".check").c_str());
}

std::string PackedCache::staged(const std::string& path) { return staged_name(path); }

void PackedCache::touch(const std::string& path) { utimensat(AT_FDCWD, path.c_str(), nullptr, 0); }

std::vector<PackedCache::CacheFile> PackedCache::published_files() const {
  std::vector<CacheFile> files;
  DIR* dir = opendir(dir_.c_str());
  if (dir == nullptr) return files;
  while (const dirent* item = readdir(dir)) {
    const std::string name = item->d_name;
    if (name.size() != 32 + 8 || name.compare(32, 8, ".xnnpack") != 0) continue;
    struct stat data {}, check {};
    const std::string path = dir_ + "/" + name;
    if (stat(path.c_str(), &data) != 0 || !S_ISREG(data.st_mode)) continue;
    const int64_t used = stat((path + ".check").c_str(), &check) == 0 ? modified_time(check).tv_sec : 0;
    files.push_back({path, static_cast<uint64_t>(data.st_size), used});
  }
  closedir(dir);
  return files;
}

void PackedCache::keep_within_limit(const std::string& keep) {
  remove_orphaned_stages();
  auto files = published_files();
  uint64_t total = 0;
  for (const auto& file : files) total += file.size;
  std::sort(files.begin(), files.end(), [](const CacheFile& a, const CacheFile& b) { return a.used < b.used; });
  for (const auto& file : files) {
    if (total <= limit_) break;
    if (file.path == keep) continue;
    remove(file.path);  // a process that has it mapped keeps its pages: only the name goes
    checked_.erase(file.path);
    total -= file.size;
  }
}

void PackedCache::remove_orphaned_stages() const {
  remove_files_left(dir_, [](const std::string& name) {
    if (name.size() >= 32 + 8 && name.compare(32, 8, ".xnnpack") == 0 && name.find('/') == std::string::npos)
      return name.find(".tmp-", 32);
    return VerifiedFiles::staged_at(name);
  });
}

// The backend grows its file with ftruncate and writes it through a shared mapping (executorch
// backends/xnnpack/runtime/XNNWeightsCache.cpp reserve_space, :389 and :400-405 at main cff6f4dd), so a write past the
// free space is a SIGBUS, not an error; and it empties the file first (initialize_for_runtime, :167-183), which gives
// back any space set aside in it before, so the room is checked instead. The file holds each packed tensor on pages of
// its own and an index (save_packed_index): 1.2-1.3 times the graph's files on the tests' bundle (an expert: 152,940
// bytes for 120,860); twice them and 4 MiB (page rounding, a copy being published beside it, other writers) is the
// room asked. A process limited in the size of its files (RLIMIT_FSIZE) would get SIGXFSZ instead: the same check
// holds against the limit.
bool PackedCache::room_for(const Graph& graph, const std::string& graph_key) {
  const uint64_t needed = 2 * static_cast<uint64_t>(std::max<int64_t>(graph.load_bytes(), 0)) + (uint64_t{4} << 20);
  struct statvfs disk {};
  rlimit file_size {};
  uint64_t room = UINT64_MAX;
  std::string shortage;
  if (statvfs(dir_.c_str(), &disk) == 0) {
    room = uint64_t(disk.f_bavail) * disk.f_frsize;
    shortage = std::to_string(room) + " bytes free in " + dir_ + ", " + std::to_string(needed) + " asked; free some "
               "storage";
  }
  if (getrlimit(RLIMIT_FSIZE, &file_size) == 0 && file_size.rlim_cur != RLIM_INFINITY && file_size.rlim_cur < room) {
    room = file_size.rlim_cur;
    shortage = "this process may write files of at most " + std::to_string(room) + " bytes (RLIMIT_FSIZE), " +
               std::to_string(needed) + " asked";
  }
  if (room >= needed) return true;
  if (no_room_.insert(graph_key).second)
    library_log(MM_LOG_ERROR, "packed-weight cache: no room for graph " + graph.name +
                                  "'s packed weights, packed in memory instead (" + shortage + ")");
  return false;
}

bool PackedCache::trusted(const PackedCacheEntry& entry) {
  const std::string& path = entry.path;
  Identity now = identity(path);
  if (now == Identity{}) return false;
  auto seen = checked_.find(path);
  if (seen != checked_.end() && seen->second == now) return true;
  checked_.erase(path);
  std::ifstream in(path + ".check");
  std::string word1, word2, word3, key, digest;
  int format = 0;
  uint64_t size = 0;
  if (!(in >> word1 >> word2 >> word3 >> format >> key >> size >> digest) || format != kPackedCacheFormat ||
      key != entry.key)
    return false;
  if (static_cast<uint64_t>(std::get<2>(now)) != size) return false;  // its size first: a short file is not read
  uint64_t actual_size = 0;
  if (file_xxh64(path, &actual_size) != digest || actual_size != size) return false;
  checked_[path] = now;
  return true;
}

}  // namespace mobile_moe::library
