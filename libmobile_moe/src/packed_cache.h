// XNNPACK's packed weights kept on disk, one cache file per graph, so a second load of an expert maps its weights
// already packed instead of packing them again. Part of libmobile_moe.
//
// ExecuTorch's XNNPACK backend writes and reads the file itself when a load passes it the per-load backend options
// weight_cache_enabled and packed_cache_path (backends/xnnpack/runtime/XNNPACKBackend.cpp, init(): "Only honor a path
// coming through runtime_spec"; the file format is XNNWeightsCache.cpp's save_packed_index / load_packed_cache). It
// keys packed weights by named-data key and bias key and XNNPACK's micro-kernel seed, so:
//   - each graph gets its own file, named by the graph's program and weights sha256s and the runtime's identity:
//     experts sharing one program share every key, and a file from another bundle or runtime is never opened;
//   - the backend checks the index's bounds but not the packed bytes (load_packed_cache maps them as they are), so a
//     flipped byte in a cache file would be a wrong answer. Here every file we let the backend read carries a
//     check file beside it (its size and XXH64); a file without one, or that does not match, is removed and rebuilt
//     by the load: a miss, never a crash or a wrong answer. A file checked once in this process is trusted while its
//     inode, size and mtime stay the same (the backend rewrites nothing on a hit).
// The cache directory is the app's, or the user's (outside the bundle, so the bundle's sha256s stay valid), shared by
// every run and every process: a load that packs has the backend write a staged file of its own, which is published
// under the graph's name (with its check file) by rename, an expert's as a copy in large writes (copy_in_large_writes
// says why), so a file that another process checks or maps is never written in place. The directory is kept under a
// size limit by removing the least recently used graphs' files (a use touches the check file). The runner only ever
// removes files it names: <key>.xnnpack, <key>.xnnpack.check, its own staged files and their copies, the staged files
// of runners that are gone (the verified-files list's among them), and the scratch files of a cold-switch measurement.
// A folder without room for a graph's file (a phone's full storage) is not used for that graph: room_for says why.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

// The runtime's identity (CMakeLists.txt passes ExecuTorch's version), which names the cache files; mm_version
// (mobile_moe_api.cpp) quotes it too, so its fallback is defined here, where both see it.
#ifndef MOBILE_MOE_RUNTIME_ID
#define MOBILE_MOE_RUNTIME_ID "executorch-unknown"
#endif

namespace mobile_moe::library {

struct Graph;

// XXH64 of a whole file as 16 hex digits; empty when it cannot be read.
std::string file_xxh64(const std::string& path, uint64_t* size);

// mkdir -p: false (errno says why) where a part cannot be made.
bool make_folders(const std::string& dir);

// Why `dir` cannot hold packed weights ("" when it can), as words that follow "folder DIR: ". The length first: a
// path too long is refused before any part of it is made.
std::string cache_path_too_long(const std::string& dir);
std::string unusable_cache_folder(const std::string& dir);

// The folder that a runner started without a weight cache folder, and an app that leaves options.weight_cache_dir
// NULL, keep packed weights in (the toolkit asks for it: mm_default_weight_cache_dir): MOBILE_MOE_WEIGHT_CACHE, else
// $MOBILE_MOE_CACHE/packed-weights, else $XDG_CACHE_HOME/mobile-moe/packed-weights (where XDG_CACHE_HOME is absolute),
// else $HOME/.cache/mobile-moe/packed-weights (the password database's home where HOME is unset, empty or relative);
// created on first use. The app did not choose it, so a folder that cannot be used (none derived, as on a phone's
// shell; one that cannot be made or written; a path too long for the backend) refuses nothing: it is "" (the run
// packs on the heap, as with no folder), with a line at the log callback saying why.
std::string default_cache_dir(std::string* off_because = nullptr);

// How a load met its graph's cache file.
enum class PackedCacheState { Off, Cold, Warm };
const char* state_name(PackedCacheState state);

struct PackedCacheEntry {
  std::string path;  // the file the backend reads or writes; empty: no cache (weights packed on the heap)
  std::string key;   // what the file holds: the graph's files and the runtime, hashed (also its name)
  PackedCacheState state = PackedCacheState::Off;
  std::string published;  // cold: the graph's file, which `path` (staged) becomes once the backend has written it
  // An expert's file, mapped and unmapped on every switch: published as a copy in large writes (copy_in_large_writes).
  // A graph loaded once per process (router, dense model) is mapped once: its file is renamed as the backend wrote it.
  bool switched = false;
};

constexpr uint64_t kDefaultPackedCacheLimit = uint64_t{1} << 30;  // bytes of packed weights a cache directory keeps

class PackedCache {
 public:
  PackedCache() = default;  // off
  explicit PackedCache(std::string dir, uint64_t limit = kDefaultPackedCacheLimit);

  bool enabled() const { return !dir_.empty(); }
  const std::string& dir() const { return dir_; }  // "" when off

  // The graph's cache file (its name: the program's and weights' sha256s and the runtime) when it passes its check
  // (warm: the backend maps it); else a staged file of this process for the backend to write (cold), published
  // under the graph's name by record(). A file that fails the check is never read; the publication replaces it.
  PackedCacheEntry prepare(const Graph& graph);

  // A scratch cache file for measuring a load from an empty cache without touching the graph's own file; removed by
  // discard() once the graph is unloaded.
  PackedCacheEntry scratch(const Graph& graph);
  void discard(const PackedCacheEntry& entry);

  // After the load: "mapped" when the file was warm and the backend added nothing to it; else "packed". A file the
  // backend wrote gets its check file, and both are published under the graph's name (an expert's file as a copy;
  // a scratch file stays where it is, for discard()); then the directory is brought under its limit.
  const char* record(const PackedCacheEntry& entry);

  // The bytes of packed weights the directory holds (published files).
  uint64_t bytes_held() const;

 private:
  using Identity = std::tuple<dev_t, ino_t, off_t, int64_t, int64_t>;
  std::string dir_;
  uint64_t limit_ = kDefaultPackedCacheLimit;
  std::map<std::string, Identity> checked_;  // files whose check passed (or that we wrote), as they were then
  std::set<std::string> no_room_;             // the graphs (keys) whose files did not fit: said once per handle

  static Identity identity(const std::string& path);

  static std::string key(const Graph& graph);
  std::string file_for(const std::string& key) const { return dir_ + "/" + key + ".xnnpack"; }

  static void remove(const std::string& path);

  // A file of this process and this call (staged_files.h): two handles that pack the same graph at once write files
  // of their own, and remove_orphaned_stages reads the name back.
  static std::string staged(const std::string& path);
  static void touch(const std::string& path);

  struct CacheFile {
    std::string path;
    uint64_t size;
    int64_t used;  // its check file's mtime (touched on every use)
  };

  // The published cache files (<32 hex>.xnnpack), with their sizes and last use.
  std::vector<CacheFile> published_files() const;

  // Remove the least recently used graphs' files (never `keep`, just published) until the directory holds at most
  // limit_ bytes, and the staged files of runners that are no longer running (a killed run's leftovers).
  void keep_within_limit(const std::string& keep);

  // Staged and scratch files (<key>.xnnpack.tmp-<pid>-<n>@<host>...) and the verified-files list's staged files, of
  // runners that are gone (staged_files.h): what a failed or killed run left.
  void remove_orphaned_stages() const;

  // Whether the folder has room for the file the backend would write for `graph`; where it has not, the graph is
  // packed in memory (the cache off for this load) and the log says why, once (packed_cache.cpp says how much room).
  bool room_for(const Graph& graph, const std::string& graph_key);

  // The file exists, and matches its check file (this key, size and XXH64: a file copied from another graph's name
  // with its check file is foreign), or is the one this process checked and it has not changed since.
  bool trusted(const PackedCacheEntry& entry);
};

}  // namespace mobile_moe::library
