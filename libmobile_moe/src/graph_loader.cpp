// graph_loader.h: a graph loaded the way the fast path needs, each load timed in its parts.
#include "graph_loader.h"

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

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// The program's forward signature must be the graph's specs from the manifest: as many inputs and outputs, each a
// float32 tensor of the listed shape. Checked before the method is initialised, so nothing runs on a mismatch.
static void check_signature(const et::Program& program, const Graph& graph) {
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

namespace {

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

}  // namespace

// A file opened for ExecuTorch: mapped (pages come in lazily, as with Module's LoadMode::Mmap) or read into memory.
// Mapped, an expert's files are mapped whole (WholeFileDataLoader: no mappings made per switch), and the graphs loaded
// once (router, dense model, trunk tail, shared halves, head) piece by piece, as ExecuTorch's Module maps them: the
// pages the kernel maps around a touched one (fault-around) then stay inside the piece, not the file (whole, dense.pte
// kept 0.12 MB more resident).
//
// A file is opened only as it was verified at open (file_identity.h): one changed since (replaced by an update, written
// in place) is refused, never run with bytes nobody checked.
static std::unique_ptr<et::DataLoader> open_data_loader(const Graph& graph, const File& file, LoadMode mode) {
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

std::vector<PlannedArenas::Arena> PlannedArenas::take(const std::vector<size_t>& sizes) {
  if (arenas_.size() < sizes.size()) arenas_.resize(sizes.size());
  std::vector<Arena> taken;
  for (size_t id = 0; id < sizes.size(); ++id) {
    if (arenas_[id] == nullptr || arenas_[id]->size() < sizes[id])
      arenas_[id] = std::make_shared<std::vector<uint8_t>>(sizes[id]), bytes_made_ += sizes[id];
    taken.push_back(arenas_[id]);
  }
  return taken;
}

// A parsed, verified program and the loader it reads from (which must outlive it).
struct ProgramFile {
  std::unique_ptr<et::DataLoader> loader;
  std::optional<et::Program> program;
};

// ExecuTorch's XNNPACK backend keeps one process-wide manager of packed-weight caches (XNNWeightsCacheManager, by
// path): a method's init asks it for a cache (get_or_create, which also erases expired entries), a method's
// destruction destroys its cache, and the two are not synchronised with each other (ThreadSanitizer saw one handle's
// mm_close race another handle's expert load). Every method init and destruction, of every handle and thread, takes
// this lock; loads in two handles at once take turns (a load is milliseconds; predictions still run together).
static std::mutex& backend_lock() {
  static std::mutex* lock = new std::mutex();  // never destroyed: a handle may close during exit
  return *lock;
}

LoadedGraph::~LoadedGraph() {
  std::lock_guard<std::mutex> lock(backend_lock());
  method_.reset();  // the backend's destroy (its weights cache) under the lock; the rest after, as declared
}

void LoadedGraph::park_weights() const {
  for (const auto& mapping : packed_mappings_)
    madvise(reinterpret_cast<void*>(mapping.begin), mapping.size, MADV_DONTNEED);
  if (auto* whole = dynamic_cast<const WholeFileDataLoader*>(weights_loader_.get())) whole->drop_pages();
}

void LoadedGraph::bring_in_packed_weights() const {
  volatile uint64_t sink = 0;
  for (const auto& mapping : packed_mappings_) {
    uint64_t sum = 0;
    for (uintptr_t at = mapping.begin; at < mapping.begin + mapping.size; at += 64)
      sum += *reinterpret_cast<const volatile uint64_t*>(at);
    sink = sink + sum;
  }
}

std::unique_ptr<LoadedGraph> Loader::load(const Graph& graph, bool scratch, bool warm_weights) {
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

void Loader::unload(std::unique_ptr<LoadedGraph> graph, bool scratch) {
  PackedCacheEntry entry = graph->cache_entry_;
  graph.reset();
  if (scratch) packed_cache_.discard(entry);
}

const LoadEvent* Loader::event(int64_t index) const {
  if (index < loads_dropped_ || index >= load_count()) return nullptr;
  return &events_[static_cast<size_t>(index - loads_dropped_)];
}

void Loader::keep(const LoadEvent& event) {
  events_.push_back(event);
  if (kept_loads_ >= 0 && static_cast<int64_t>(events_.size()) > kept_loads_) {
    events_.pop_front();
    ++loads_dropped_;
  }
}

void Loader::locate_packed_weights(LoadedGraph& loaded) {
  struct stat info {};
  const PackedCacheEntry& entry = loaded.cache_entry_;
  if (entry.state != PackedCacheState::Warm || stat(entry.path.c_str(), &info) != 0) return;
  auto mappings = stats::mappings_of_file(info.st_dev, info.st_ino);
  if (std::all_of(mappings.begin(), mappings.end(), [](const auto& m) { return m.shared && !m.writable; }))
    loaded.packed_mappings_ = std::move(mappings);
}

std::shared_ptr<ProgramFile> Loader::program_for(const Graph& graph) {
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

void Loader::open_weights(const Graph& graph, LoadedGraph& loaded) {
  loaded.weights_loader_ = open_data_loader(graph, graph.weights, mode_);
  auto map = executorch::extension::FlatTensorDataMap::load(loaded.weights_loader_.get());
  if (!map.ok())
    throw BundleError("graph " + graph.name + ": " + graph.weights.file + " is not a valid ExecuTorch data file " +
                     runtime_error_text(map.error()) + "; re-export the bundle");
  loaded.weights_.emplace(std::move(*map));
}

void Loader::set_cache_options(const Graph& graph, LoadedGraph& loaded, bool scratch) {
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

void Loader::init_method(const Graph& graph, LoadedGraph& loaded) {
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

}  // namespace mobile_moe::library
