// Load a graph the way the fast path needs (part of libmobile_moe):
//   - a program file is parsed and verified ONCE and shared: every expert of a family
//     (mobile_moe/export/executorch_family.py) loads its method from the one parsed program;
//   - each graph's method gets its own weights (a FlatTensorDataMap of its .ptd) and its own XNNPACK options (its
//     packed-weight cache file, packed_cache.h), through
//     Program::load_method(name, memory_manager, tracer, named_data_map, backend_options)
//     (include/executorch/runtime/executor/program.h:159-165). extension/module's Module cannot do this: its
//     shared-program constructor never builds the data map (extension/module/module.cpp), so this is one level down;
//   - every graph's planned memory is a view of one arena per memory id (PlannedArenas), since a bundle's graphs run
//     one after another and hold nothing between runs.
// Every load is timed in its parts (program, data map, cache check, method init, cache record), so a switch's
// milliseconds are all accounted for.
#pragma once

#include <executorch/extension/flat_tensor/flat_tensor_data_map.h>
#include <executorch/extension/memory_allocator/malloc_memory_allocator.h>
#include <executorch/runtime/backend/backend_options_map.h>
#include <executorch/runtime/backend/options.h>
#include <executorch/runtime/core/data_loader.h>
#include <executorch/runtime/core/hierarchical_allocator.h>
#include <executorch/runtime/core/span.h>
#include <executorch/runtime/executor/memory_manager.h>
#include <executorch/runtime/executor/method.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "packed_cache.h"
#include "process_mappings.h"

namespace mobile_moe::library {

struct Graph;
class HandleThreads;
struct ProgramFile;  // a parsed program and its loader (graph_loader.cpp)

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point start);

namespace et = executorch::runtime;

// One load, in parts: program_ms (open, parse and verify the program; 0 when the family's program was already
// parsed), data_map_ms (open the .ptd and read its header), cache_check_ms (check the packed-weight cache file),
// method_ms (initialise the method: XNNPACK builds its runtime and packs, or maps packed, weights), cache_record_ms
// (hash a cache file the load wrote), bring_in_ms (prefetching only: LoadedGraph::bring_in_packed_weights).
// weights: "packed" or "mapped" (from a warm cache file). Its strings are the bundle's graph name and static words:
// they live as long as the handle, whatever happens to the event.
// The load events a handle keeps by default (mm_load_settings.kept_loads): a bounded record for a long-running app.
constexpr int64_t kDefaultKeptLoads = 64;

struct LoadEvent {
  const char* graph = "";
  int64_t bytes = 0;
  double ms = 0;
  double program_ms = 0, data_map_ms = 0, cache_check_ms = 0, method_ms = 0, cache_record_ms = 0;
  double bring_in_ms = 0;  // prefetching: reading the mapped packed weights in on the loading thread
  const char* weights = "packed";
  const char* cache = "off";
};

enum class LoadMode { Mmap, File };

// The planned memory of every graph one Loader loads: one arena per memory id, each as large as the largest buffer of
// that id a graph has asked for, and every graph's buffer a view of it. Sharing is safe because a bundle's graphs
// run one after another on one thread and hold nothing in planned memory between runs: the runner copies each
// input in and each output out (graphs.h run()), and the exporter refuses a graph with state (a mutated buffer,
// executorch_backend.py lower()), the one thing ExecuTorch writes into planned memory at method init
// (runtime/executor/tensor_parser_exec_aten.cpp getTensorDataPtr, "Memory Planned, with initial state"), so a
// prefetching thread's method init leaves alone the arena that the image's thread is running in. What it saves:
// an expert switch allocates and zeroes no buffer, and the experts take no memory beyond the router's (ViT-Ti/32:
// 115 KB per resident expert). A graph that needs more than an arena holds gets a new, larger arena; graphs loaded
// earlier keep the old one alive, so a bundle whose first graph is its largest (the router, the dense model) has one.
class PlannedArenas {
 public:
  using Arena = std::shared_ptr<std::vector<uint8_t>>;

  // The arenas for a method whose planned buffers have `sizes` (one per memory id, in order).
  std::vector<Arena> take(const std::vector<size_t>& sizes);

  // The bytes of every arena made so far.
  size_t bytes_made() const { return bytes_made_; }

 private:
  std::vector<Arena> arenas_;
  size_t bytes_made_ = 0;
};

// One loaded graph: its forward method and everything the method points into, which must outlive it. Members are
// destroyed in reverse order, so the method goes first; the program is shared with the family's other graphs. Every method init and
// destruction takes the backend's lock (graph_loader.cpp backend_lock).
class LoadedGraph {
 public:
  LoadedGraph() = default;
  ~LoadedGraph();
  LoadedGraph(const LoadedGraph&) = delete;
  LoadedGraph& operator=(const LoadedGraph&) = delete;

  et::Method& method() { return *method_; }

  // Whether its weights can leave memory while its method stays initialised (park_weights()): the backend keeps
  // them packed in a file it maps (the packed-weight cache), and the loader found those mappings.
  bool parkable() const { return !packed_mappings_.empty(); }
  // Drop its weights' pages from this process: the packed weights the backend maps and its mapped .ptd. Both are
  // read-only file mappings (Loader::locate_packed_weights keeps only those), so the next run faults the same bytes
  // back in from the page cache, and nothing is lost. The addresses stay the backend's while the method lives: it
  // unmaps a cache file's regions only when the last method using them is destroyed (XNNPACKBackend.cpp destroy ->
  // XNNWeightsCache.cpp delete_packed_data -> full_unload) or when a new load of the same file starts it afresh,
  // which the expert cache never does while this graph exists (a scratch load uses a file of its own).
  void park_weights() const;
  // Read its mapped packed weights in, one word per 64-byte line, so the page tables are filled and the weights sit
  // in the shared cache before the first run reads them: what a prefetching thread does while the trunk tail runs.
  void bring_in_packed_weights() const;
  const std::vector<stats::Mapping>& packed_mappings() const { return packed_mappings_; }

 private:
  friend class Loader;
  std::vector<stats::Mapping> packed_mappings_;  // the backend's mappings of this graph's packed-weight cache file
  std::shared_ptr<ProgramFile> program_;
  std::unique_ptr<et::DataLoader> weights_loader_;
  std::optional<executorch::extension::FlatTensorDataMap> weights_;
  std::vector<PlannedArenas::Arena> planned_arenas_;  // held while the method may run in them
  std::vector<et::Span<uint8_t>> planned_spans_;
  std::optional<et::HierarchicalAllocator> planned_memory_;
  executorch::extension::MallocMemoryAllocator method_allocator_, temp_allocator_;
  std::optional<et::MemoryManager> memory_manager_;
  et::BackendOptions<3> xnnpack_options_;
  et::LoadBackendOptionsMap backend_options_;
  PackedCacheEntry cache_entry_;
  std::optional<et::Method> method_;
};

class Loader {
 public:
  // `workspace_sharing`: XNNPACK's workspace sharing mode for every load (WorkspaceSharingMode: 0 disabled, each
  // method its own workspace; 1 per model; 2 global, one workspace for all), through the per-load option the backend
  // resolves (backends/xnnpack/runtime/XnnpackBackendOptions.cpp, resolve_sharing_mode); -1: the backend's default.
  // `locate_packed_weights`: find where the backend maps each expert's warm packed weights (LoadedGraph::parkable()).
  // `threads`: the handle's, in force around every load on whichever thread loads (thread_pool.h: XNNPACK keeps the
  // pool it was loaded with).
  // `kept_loads`: how many of the last loads' events are kept (load_count counts them all); -1: every one.
  Loader(LoadMode mode, PackedCache& packed_cache, const HandleThreads& threads, int workspace_sharing = -1,
         bool locate_packed_weights = false, int64_t kept_loads = kDefaultKeptLoads)
      : mode_(mode),
        packed_cache_(packed_cache),
        threads_(threads),
        workspace_sharing_(workspace_sharing),
        locate_packed_weights_(locate_packed_weights),
        kept_loads_(kept_loads) {}

  // Load a graph: its program (parsed once per file and kept for the family; fully verified, so a corrupt flatbuffer
  // is refused, not walked) with its signature checked against the manifest, then its forward method with its own
  // weights and packed-weight cache. `scratch`: measure a load from an empty cache, leaving the graph's own cache file
  // alone (the file is removed when the graph is unloaded, by unload()). `warm_weights`: a prefetching thread's load,
  // which also brings mapped packed weights in (bring_in_packed_weights), off the path of the image that needs them.
  std::unique_ptr<LoadedGraph> load(const Graph& graph, bool scratch = false, bool warm_weights = false);

  // Unload a graph; a scratch cache file it used goes with it (the backend has closed it by then).
  void unload(std::unique_ptr<LoadedGraph> graph, bool scratch);

  // Loads since the loader was made, and load `index`'s event where it is still kept (else null).
  int64_t load_count() const { return loads_dropped_ + static_cast<int64_t>(events_.size()); }
  const LoadEvent* event(int64_t index) const;
  int64_t first_kept() const { return loads_dropped_; }
  int64_t bytes_loaded = 0;
  size_t planned_bytes() const { return planned_arenas_.bytes_made(); }

 private:
  LoadMode mode_;
  PackedCache& packed_cache_;  // off (no directory): every load packs on the heap
  const HandleThreads& threads_;
  int workspace_sharing_;
  bool locate_packed_weights_;
  // The last kept_loads_ loads' events (-1: every one): an app that switches experts for days holds a bounded record.
  int64_t kept_loads_;
  std::deque<LoadEvent> events_;
  int64_t loads_dropped_ = 0;

  void keep(const LoadEvent& event);
  std::map<std::string, std::shared_ptr<ProgramFile>> family_programs_;  // programs that experts share, by path
  PlannedArenas planned_arenas_;

  // The backend's mappings of the warm packed-weight cache file it just mapped, found by the file's device and
  // inode; kept only when every one is shared and read-only (XNNWeightsCache.cpp load_packed_cache), the mappings
  // whose pages can be dropped and faulted back unchanged. None for a load that packed: its mappings are of a staged
  // file that PackedCache::record replaces by a copy, written through (PROT_WRITE); that expert unloads when evicted,
  // and its next load maps the copy. None either when the cache is off or the backend packed onto its heap (it could
  // not lock the file).
  void locate_packed_weights(LoadedGraph& loaded);

  std::shared_ptr<ProgramFile> program_for(const Graph& graph);

  void open_weights(const Graph& graph, LoadedGraph& loaded);

  // XNNPACK's per-load options: this graph's own packed-weight cache file (or none), and the workspace sharing mode.
  void set_cache_options(const Graph& graph, LoadedGraph& loaded, bool scratch);

  void init_method(const Graph& graph, LoadedGraph& loaded);
};

}  // namespace mobile_moe::library
