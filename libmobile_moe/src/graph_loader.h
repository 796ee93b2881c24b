// Load a graph the way the fast path needs (part of libmobile_moe; header-only):
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

#include <executorch/extension/data_loader/buffer_data_loader.h>
#include <executorch/extension/data_loader/file_data_loader.h>
#include <executorch/extension/data_loader/mmap_data_loader.h>
#include <executorch/extension/flat_tensor/flat_tensor_data_map.h>
#include <executorch/extension/memory_allocator/malloc_memory_allocator.h>
#include <executorch/runtime/backend/backend_options_map.h>
#include <executorch/runtime/backend/options.h>
#include <executorch/runtime/core/error.h>
#include <executorch/runtime/core/hierarchical_allocator.h>
#include <executorch/runtime/executor/memory_manager.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/program.h>

#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <deque>
#include <vector>

#include "bundle_manifest.h"
#include "errors.h"
#include "flatbuffer_check.h"
#include "mapped_file.h"
#include "packed_cache.h"
#include "process_mappings.h"
#include "runtime_log.h"
#include "thread_pool.h"

namespace mobile_moe::library {

using Clock = std::chrono::steady_clock;
inline double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

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

// The program's forward signature must be the graph's specs from the manifest: as many inputs and outputs, each a
// float32 tensor of the listed shape. Checked before the method is initialised, so nothing runs on a mismatch.
inline void check_signature(const et::Program& program, const Graph& graph) {
  using et::Tag;
  auto meta = program.method_meta("forward");
  if (!meta.ok())
    throw BundleError("graph " + graph.name + ": " + graph.program.file + " has no forward method " +
                     runtime_error_text(meta.error()));
  auto compare = [&](const char* what, size_t count, const std::vector<Spec>& specs, auto tag_of, auto info_of) {
    if (count != specs.size())
      throw BundleError("graph " + graph.name + ": " + graph.program.file + " takes " + std::to_string(count) + " " + what +
                       " but the manifest lists " + std::to_string(specs.size()));
    for (size_t i = 0; i < count; ++i) {
      std::string which = std::string(what) + " " + std::to_string(i) + " (" + specs[i].name + ")";
      auto tag = tag_of(i);
      if (!tag.ok() || *tag != Tag::Tensor)
        throw BundleError("graph " + graph.name + ": " + which + " of " + graph.program.file + " is not a tensor");
      auto info = info_of(i);
      if (!info.ok())
        throw BundleError("graph " + graph.name + ": " + which + " of " + graph.program.file + " has no tensor metadata");
      if (info->scalar_type() != executorch::aten::ScalarType::Float)
        throw BundleError("graph " + graph.name + ": " + which + " of " + graph.program.file + " is not float32");
      auto sizes = info->sizes();
      std::vector<int32_t> actual(sizes.begin(), sizes.end());
      if (actual != specs[i].shape)
        throw BundleError("graph " + graph.name + ": " + which + " of " + graph.program.file + " has shape " +
                         shape_text(actual) + " but the manifest says " + shape_text(specs[i].shape));
    }
  };
  compare(
      "inputs", meta->num_inputs(), graph.inputs, [&](size_t i) { return meta->input_tag(i); },
      [&](size_t i) { return meta->input_tensor_meta(i); });
  compare(
      "outputs", meta->num_outputs(), graph.outputs, [&](size_t i) { return meta->output_tag(i); },
      [&](size_t i) { return meta->output_tensor_meta(i); });
}

enum class LoadMode { Mmap, File };

// A file mapped whole, once (MappedFile), for as long as its graph (or its family's program) is loaded; each piece
// ExecuTorch asks for is a view into that mapping, bounds-checked by ExecuTorch's BufferDataLoader, and holds the
// mapping until it is freed. For the files an expert switch opens (open_data_loader): ExecuTorch's MmapDataLoader
// maps each piece on load() and unmaps it when freed (extension/data_loader/mmap_data_loader.cpp), and an expert's
// method init asks for every unpacked weight of its program and .ptd (XNNWeightsCache.cpp load_unpacked_data), so a
// switch made and dropped about 20 mappings of weights that a packed-weight cache hit never reads (the method init
// this saves: benchmarks/expert_switch_vit_ti32.results.md). A freed piece's whole pages are dropped
// (MappedFile::drop_pages), so the weights a cache miss reads to pack leave memory as they did. The mapping is
// advised MADV_NOHUGEPAGE: a bundle file that the page cache holds in 2 MiB folios (as a file written in large
// writes is) would otherwise be mapped 2 MiB at a time, all of it resident for one touched page.
class WholeFileDataLoader final : public et::DataLoader {
 public:
  // nullptr when the file cannot be opened or mapped, or is empty (errno says why).
  static std::unique_ptr<WholeFileDataLoader> open(const std::string& path) {
    auto file = MappedFile::open(path, MADV_NOHUGEPAGE);
    if (file == nullptr) return nullptr;
    if (file->size() == 0) {
      errno = EINVAL;  // no program or data file is empty
      return nullptr;
    }
    return std::unique_ptr<WholeFileDataLoader>(new WholeFileDataLoader(std::move(file)));
  }

  et::Result<et::FreeableBuffer> load(size_t offset, size_t size, const SegmentInfo& info) const override {
    auto piece = pieces_.load(offset, size, info);
    if (!piece.ok()) return piece.error();
    return et::FreeableBuffer(piece->data(), size, free_piece, new std::shared_ptr<const MappedFile>(file_));
  }
  et::Result<size_t> size() const override { return file_->size(); }
  void drop_pages() const { file_->drop_pages(file_->data(), file_->size()); }  // every whole page of the file
  const FileIdentity& identity() const { return file_->identity(); }
  et::Error load_into(size_t offset, size_t size, const SegmentInfo& info, void* buffer) const override {
    return pieces_.load_into(offset, size, info, buffer);
  }

 private:
  explicit WholeFileDataLoader(std::shared_ptr<const MappedFile> file)
      : file_(std::move(file)), pieces_(file_->data(), file_->size()) {}

  static void free_piece(void* holder, void* data, size_t size) {
    auto* file = static_cast<std::shared_ptr<const MappedFile>*>(holder);
    (*file)->drop_pages(data, size);
    delete file;
  }

  std::shared_ptr<const MappedFile> file_;
  executorch::extension::BufferDataLoader pieces_;
};

// A file opened for ExecuTorch: mapped (pages come in lazily, as with Module's LoadMode::Mmap) or read into memory.
// Mapped, an expert's files are mapped whole (WholeFileDataLoader: no mappings made per switch), and the graphs loaded
// once (router, dense model, trunk tail, shared halves, head) piece by piece, as ExecuTorch's Module maps them: the
// pages the kernel maps around a touched one (fault-around) then stay inside the piece, not the file (whole, dense.pte
// kept 0.12 MB more resident).
//
// A file is opened only as it was verified at open (file_identity.h): one changed since (replaced by an update, written
// in place) is refused, never run with bytes nobody checked.
inline std::unique_ptr<et::DataLoader> open_data_loader(const Graph& graph, const File& file, LoadMode mode) {
  using executorch::extension::FileDataLoader;
  using executorch::extension::MmapDataLoader;
  auto changed = [&]() {
    return FileFault("graph " + graph.name + ": " + file.file + " changed since the bundle was opened (another file, " +
                     "size or modification time than the one verified then); a bundle must not change while a " +
                     "handle is open: write an update into a new folder and open a new handle on it");
  };
  if (file.verified.known() && identify(file.path) != file.verified) throw changed();
  if (mode == LoadMode::Mmap && graph.switched()) {  // an expert, loaded again and again: checked as mapped, too
    if (auto loader = WholeFileDataLoader::open(file.path)) {
      if (file.verified.known() && loader->identity() != file.verified) throw changed();
      return loader;
    }
    const std::string why = std::strerror(errno);
    throw BundleError("graph " + graph.name + ": cannot open " + file.file + " (" + why + ")");
  }
  if (mode == LoadMode::Mmap) {
    auto loader = MmapDataLoader::from(file.path.c_str(), MmapDataLoader::MlockConfig::NoMlock);
    if (loader.ok()) return std::make_unique<MmapDataLoader>(std::move(*loader));
    throw BundleError("graph " + graph.name + ": cannot open " + file.file + " " + runtime_error_text(loader.error()));
  }
  auto loader = FileDataLoader::from(file.path.c_str());
  if (loader.ok()) return std::make_unique<FileDataLoader>(std::move(*loader));
  throw BundleError("graph " + graph.name + ": cannot open " + file.file + " " + runtime_error_text(loader.error()));
}

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
  std::vector<Arena> take(const std::vector<size_t>& sizes) {
    if (arenas_.size() < sizes.size()) arenas_.resize(sizes.size());
    std::vector<Arena> taken;
    for (size_t id = 0; id < sizes.size(); ++id) {
      if (arenas_[id] == nullptr || arenas_[id]->size() < sizes[id])
        arenas_[id] = std::make_shared<std::vector<uint8_t>>(sizes[id]), bytes_made_ += sizes[id];
      taken.push_back(arenas_[id]);
    }
    return taken;
  }

  // The bytes of every arena made so far.
  size_t bytes_made() const { return bytes_made_; }

 private:
  std::vector<Arena> arenas_;
  size_t bytes_made_ = 0;
};

// A parsed, verified program and the loader it reads from (which must outlive it).
struct ProgramFile {
  std::unique_ptr<et::DataLoader> loader;
  std::optional<et::Program> program;
};

// One loaded graph: its forward method and everything the method points into, which must outlive it. Members are
// destroyed in reverse order, so the method goes first; the program is shared with the family's other graphs.
// ExecuTorch's XNNPACK backend keeps one process-wide manager of packed-weight caches (XNNWeightsCacheManager, by
// path): a method's init asks it for a cache (get_or_create, which also erases expired entries), a method's
// destruction destroys its cache, and the two are not synchronised with each other (ThreadSanitizer saw one handle's
// mm_close race another handle's expert load). Every method init and destruction, of every handle and thread, takes
// this lock; loads in two handles at once take turns (a load is milliseconds; predictions still run together).
inline std::mutex& backend_lock() {
  static std::mutex* lock = new std::mutex();  // never destroyed: a handle may close during exit
  return *lock;
}

class LoadedGraph {
 public:
  LoadedGraph() = default;
  ~LoadedGraph() {
    std::lock_guard<std::mutex> lock(backend_lock());
    method_.reset();  // the backend's destroy (its weights cache) under the lock; the rest after, as declared
  }
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
  void park_weights() const {
    for (const auto& mapping : packed_mappings_)
      madvise(reinterpret_cast<void*>(mapping.begin), mapping.size, MADV_DONTNEED);
    if (auto* whole = dynamic_cast<const WholeFileDataLoader*>(weights_loader_.get())) whole->drop_pages();
  }
  // Read its mapped packed weights in, one word per 64-byte line, so the page tables are filled and the weights sit
  // in the shared cache before the first run reads them: what a prefetching thread does while the trunk tail runs.
  void bring_in_packed_weights() const {
    volatile uint64_t sink = 0;
    for (const auto& mapping : packed_mappings_) {
      uint64_t sum = 0;
      for (uintptr_t at = mapping.begin; at < mapping.begin + mapping.size; at += 64)
        sum += *reinterpret_cast<const volatile uint64_t*>(at);
      sink = sink + sum;
    }
  }
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
  std::unique_ptr<LoadedGraph> load(const Graph& graph, bool scratch = false, bool warm_weights = false) {
    const auto threads = threads_.scope();
    auto start = Clock::now();
    LoadEvent event{graph.name.c_str(), graph.load_bytes()};
    auto loaded = std::make_unique<LoadedGraph>();
    loaded->program_ = program_for(graph);
    event.program_ms = ms_since(start);
    if (graph.shares_program()) {
      auto map_start = Clock::now();
      open_weights(graph, *loaded);
      event.data_map_ms = ms_since(map_start);
    }
    auto check_start = Clock::now();
    set_cache_options(graph, *loaded, scratch);
    event.cache_check_ms = ms_since(check_start);
    auto method_start = Clock::now();
    init_method(graph, *loaded);
    event.method_ms = ms_since(method_start);
    if ((locate_packed_weights_ || warm_weights) && graph.switched()) locate_packed_weights(*loaded);
    auto record_start = Clock::now();
    event.weights = packed_cache_.record(loaded->cache_entry_);
    event.cache_record_ms = ms_since(record_start);
    if (warm_weights && std::string_view(event.weights) == "mapped") {
      auto bring_in_start = Clock::now();
      loaded->bring_in_packed_weights();
      event.bring_in_ms = ms_since(bring_in_start);
    }
    event.cache = state_name(loaded->cache_entry_.state);
    event.ms = ms_since(start);
    keep(event);
    bytes_loaded += graph.load_bytes();
    return loaded;
  }

  // Unload a graph; a scratch cache file it used goes with it (the backend has closed it by then).
  void unload(std::unique_ptr<LoadedGraph> graph, bool scratch) {
    PackedCacheEntry entry = graph->cache_entry_;
    graph.reset();
    if (scratch) packed_cache_.discard(entry);
  }

  // Loads since the loader was made, and load `index`'s event where it is still kept (else null).
  int64_t load_count() const { return loads_dropped_ + static_cast<int64_t>(events_.size()); }
  const LoadEvent* event(int64_t index) const {
    if (index < loads_dropped_ || index >= load_count()) return nullptr;
    return &events_[static_cast<size_t>(index - loads_dropped_)];
  }
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

  void keep(const LoadEvent& event) {
    events_.push_back(event);
    if (kept_loads_ >= 0 && static_cast<int64_t>(events_.size()) > kept_loads_) {
      events_.pop_front();
      ++loads_dropped_;
    }
  }
  std::map<std::string, std::shared_ptr<ProgramFile>> family_programs_;  // programs that experts share, by path
  PlannedArenas planned_arenas_;

  // The backend's mappings of the warm packed-weight cache file it just mapped, found by the file's device and
  // inode; kept only when every one is shared and read-only (XNNWeightsCache.cpp load_packed_cache), the mappings
  // whose pages can be dropped and faulted back unchanged. None for a load that packed: its mappings are of a staged
  // file that PackedCache::record replaces by a copy, written through (PROT_WRITE); that expert unloads when evicted,
  // and its next load maps the copy. None either when the cache is off or the backend packed onto its heap (it could
  // not lock the file).
  void locate_packed_weights(LoadedGraph& loaded) {
    struct stat info {};
    const PackedCacheEntry& entry = loaded.cache_entry_;
    if (entry.state != PackedCacheState::Warm || stat(entry.path.c_str(), &info) != 0) return;
    auto mappings = stats::mappings_of_file(info.st_dev, info.st_ino);
    if (std::all_of(mappings.begin(), mappings.end(), [](const auto& m) { return m.shared && !m.writable; }))
      loaded.packed_mappings_ = std::move(mappings);
  }

  std::shared_ptr<ProgramFile> program_for(const Graph& graph) {
    if (graph.shares_program()) {
      auto found = family_programs_.find(graph.program.path);
      if (found != family_programs_.end()) return found->second;
    }
    auto file = std::make_shared<ProgramFile>();
    file->loader = open_data_loader(graph, graph.program, mode_);
    auto program = et::Program::load(file->loader.get(), et::Program::Verification::InternalConsistency);
    if (!program.ok())
      throw BundleError("graph " + graph.name + ": " + graph.program.file + " is not a valid ExecuTorch program " +
                       runtime_error_text(program.error()) + "; re-export the bundle");
    file->program.emplace(std::move(*program));
    check_signature(*file->program, graph);
    // Kept for the family's other experts: one parsed program per family, however many experts come and go. A
    // program with its weights inside is not kept: its mapping would hold those weights' pages.
    if (graph.shares_program()) family_programs_[graph.program.path] = file;
    return file;
  }

  void open_weights(const Graph& graph, LoadedGraph& loaded) {
    loaded.weights_loader_ = open_data_loader(graph, graph.weights, mode_);
    auto map = executorch::extension::FlatTensorDataMap::load(loaded.weights_loader_.get());
    if (!map.ok())
      throw BundleError("graph " + graph.name + ": " + graph.weights.file + " is not a valid ExecuTorch data file " +
                       runtime_error_text(map.error()) + "; re-export the bundle");
    loaded.weights_.emplace(std::move(*map));
  }

  // XNNPACK's per-load options: this graph's own packed-weight cache file (or none), and the workspace sharing mode.
  void set_cache_options(const Graph& graph, LoadedGraph& loaded, bool scratch) {
    if (packed_cache_.enabled())  // off for this graph where its folder has no room (PackedCache::room_for)
      loaded.cache_entry_ = scratch ? packed_cache_.scratch(graph) : packed_cache_.prepare(graph);
    if (loaded.cache_entry_.state != PackedCacheState::Off) {
      loaded.xnnpack_options_.set_option("weight_cache_enabled", true);
      loaded.xnnpack_options_.set_option("packed_cache_path", loaded.cache_entry_.path.c_str());
    }
    if (workspace_sharing_ >= 0) loaded.xnnpack_options_.set_option("workspace_sharing_mode", workspace_sharing_);
    if (loaded.xnnpack_options_.view().size() == 0) return;
    auto status = loaded.backend_options_.set_options("XnnpackBackend", loaded.xnnpack_options_.view());
    if (status != et::Error::Ok)
      throw std::runtime_error("this ExecuTorch build refuses XNNPACK's per-load options " + runtime_error_text(status));
  }

  void init_method(const Graph& graph, LoadedGraph& loaded) {
    const et::Program& program = *loaded.program_->program;
    auto meta = program.method_meta("forward");
    if (!meta.ok()) throw BundleError("graph " + graph.name + ": no forward method " + runtime_error_text(meta.error()));
    std::vector<size_t> sizes;
    for (size_t i = 0; i < meta->num_memory_planned_buffers(); ++i) {
      auto size = meta->memory_planned_buffer_size(i);
      if (!size.ok())
        throw BundleError("graph " + graph.name + ": unreadable memory plan " + runtime_error_text(size.error()));
      sizes.push_back(static_cast<size_t>(*size));
    }
    loaded.planned_arenas_ = planned_arenas_.take(sizes);
    for (size_t id = 0; id < sizes.size(); ++id)
      loaded.planned_spans_.emplace_back(loaded.planned_arenas_[id]->data(), sizes[id]);
    loaded.planned_memory_.emplace(
        et::Span<et::Span<uint8_t>>(loaded.planned_spans_.data(), loaded.planned_spans_.size()));
    loaded.memory_manager_.emplace(&loaded.method_allocator_, &*loaded.planned_memory_, &loaded.temp_allocator_);
    const et::NamedDataMap* weights = loaded.weights_ ? &*loaded.weights_ : nullptr;
    const et::LoadBackendOptionsMap* options = loaded.backend_options_.size() > 0 ? &loaded.backend_options_ : nullptr;
    std::unique_lock<std::mutex> backend(backend_lock());  // the backend's process-wide cache manager (backend_lock)
    auto method = program.load_method("forward", &*loaded.memory_manager_, nullptr, weights, options);
    backend.unlock();
    if (!method.ok())
      throw BundleError("graph " + graph.name + ": initialising " + graph.program.file + " failed " +
                       runtime_error_text(method.error()) + "; re-export the bundle with this ExecuTorch version");
    loaded.method_.emplace(std::move(*method));
  }
};

}  // namespace mobile_moe::library
