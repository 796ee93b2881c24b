// libmobile_moe's measurement interface (mobile_moe_measure.h): the handle's loader, expert cache and pipeline, read
// and driven one step at a time, for a benchmark (the native runner) or an app that measures itself. Each call locks
// its handle as mobile_moe_api.cpp's do (handles.h) and runs on the handle's threads.
#include "mobile_moe_measure.h"

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "bundle_manifest.h"
#include "graph_loader.h"
#include "graphs.h"
#include "handles.h"
#include "model.h"
#include "process_mappings.h"
#include "struct_abi.h"

namespace {

using namespace mobile_moe::library;

// mm_bundle_kind is manifest_schema.h's Kind, number for number.
static_assert(static_cast<int>(Kind::Split) == MM_BUNDLE_SPLIT && static_cast<int>(Kind::Dense) == MM_BUNDLE_DENSE &&
              static_cast<int>(Kind::Monolithic) == MM_BUNDLE_MONOLITHIC &&
              static_cast<int>(Kind::Whole) == MM_BUNDLE_WHOLE);

// A getter of one struct: the handle open and locked, `out` at least its size field, `fill(handle, full)` filling the
// whole struct (or failing), then as much of it as the app's struct_size holds copied out.
template <typename Struct, typename Fill>
mm_status get_struct(const char* call, const mm_model* model, Struct* out, size_t struct_size, Fill fill) {
  Locked open(model);
  if (open.model == nullptr) return not_open(call, model);
  if (out == nullptr || struct_size < sizeof(size_t))
    return failed(MM_BAD_ARGUMENT, std::string(call) + ": the struct is NULL, or its size " +
                                       std::to_string(struct_size) + " is less than a size_t; read it through " +
                                       "the inline mm_get_* call, which passes the app's sizeof");
  Struct full{};
  const mm_status status = fill(*open.model, full);
  if (status == MM_OK) copy_out(out, full, struct_size);
  return status;
}

mm_load_settings default_load_settings() {
  mm_load_settings settings{};
  settings.struct_size = sizeof(mm_load_settings);
  settings.read_files = 0;
  settings.workspace_sharing = -1;
  settings.kept_loads = static_cast<int>(kDefaultKeptLoads);
  return settings;
}

LoadSettings load_settings(const mm_load_settings* given) {
  mm_load_settings settings = default_load_settings();
  if (given != nullptr) {
    if (given->struct_size < sizeof(size_t) || given->struct_size > kMaxStructSize)
      throw UsageError("load->struct_size is " + std::to_string(given->struct_size) +
                       ": initialise the settings with mm_default_load_settings(&load) before setting them");
    copy_whole_fields(&settings, *given, given->struct_size,
                      {offsetof(mm_load_settings, read_files) + sizeof(int),
                       offsetof(mm_load_settings, workspace_sharing) + sizeof(int),
                       offsetof(mm_load_settings, kept_loads) + sizeof(int)});
  }
  if (settings.read_files != 0 && settings.read_files != 1)
    throw UsageError("load->read_files is 0 (map the graph files) or 1 (read them), not " +
                     std::to_string(settings.read_files));
  if (settings.workspace_sharing < -1 || settings.workspace_sharing > 2)
    throw UsageError("load->workspace_sharing is -1 (XNNPACK's default), 0, 1 or 2, not " +
                     std::to_string(settings.workspace_sharing));
  if (settings.kept_loads < -1)
    throw UsageError("load->kept_loads is -1 (every load) or a count, not " + std::to_string(settings.kept_loads));
  return LoadSettings{settings.read_files ? LoadMode::File : LoadMode::Mmap, settings.workspace_sharing,
                      settings.kept_loads};
}

// The expert calls' common check: a split bundle, an expert it has.
void check_expert(const mm_model& model, int expert) {
  const Bundle& bundle = model.bundle;
  if (bundle.kind != Kind::Split)
    throw UsageError(std::string("the bundle is ") + name(bundle.kind) + ": only a split bundle loads its experts");
  if (expert < 0 || expert >= bundle.num_experts)
    throw UsageError("expert " + std::to_string(expert) + " is out of range (the bundle has " +
                     std::to_string(bundle.num_experts) + ": 0.." + std::to_string(bundle.num_experts - 1) + ")");
}

}  // namespace

extern "C" {

void mm_load_settings_init(mm_load_settings* settings, size_t struct_size) {
  if (settings == nullptr || struct_size < sizeof(size_t)) return;  // not even its size field
  copy_out(settings, default_load_settings(), struct_size);
}

mm_status mm_open_with(const char* bundle_dir, const mm_options* options, const mm_load_settings* load,
                       mm_model** model) {
  if (model != nullptr) *model = nullptr;
  LoadSettings settings;
  mm_status status = guarded("mm_open_with", MM_BAD_ARGUMENT, [&] { settings = load_settings(load); });
  return status != MM_OK ? status : open_model("mm_open_with", bundle_dir, options, settings, model);
}

mm_status mm_model_info_get(const mm_model* model, mm_model_info* info, size_t struct_size) {
  return get_struct("mm_model_info_get", model, info, struct_size, [](const mm_model& handle, mm_model_info& full) {
    const Bundle& bundle = handle.bundle;
    full.bundle_dir = bundle.dir.c_str();
    full.kind = static_cast<int>(bundle.kind);
    full.kind_name = name(bundle.kind);
    full.layout = name(bundle.layout);
    full.weight_cache_dir = handle.packed_cache.dir().c_str();
    full.threads = static_cast<int>(handle.threads.threads());
    full.num_experts = bundle.num_experts;
    full.top_k = bundle.top_k;
    full.cache_experts = handle.cache_experts;
    full.prefetch = handle.prefetch ? 1 : 0;
    full.has_trunk_tail = bundle.trunk_tail.name.empty() ? 0 : 1;
    full.graphs = static_cast<int>(bundle.all.size());
    full.resident_load_ms = handle.resident_load_ms;
    full.weight_cache_off = handle.weight_cache_off.c_str();
    return MM_OK;
  });
}

mm_status mm_graph(const mm_model* model, int index, const char** name, int64_t* load_bytes) {
  Locked open(model);
  if (open.model == nullptr) return not_open("mm_graph", model);
  const auto& graphs = open.model->bundle.all;
  if (index < 0 || index >= static_cast<int>(graphs.size()))
    return failed(MM_BAD_ARGUMENT, "mm_graph: index " + std::to_string(index) + " is out of range (0.." +
                                       std::to_string(static_cast<int>(graphs.size()) - 1) + ")");
  if (name != nullptr) *name = graphs[static_cast<size_t>(index)].name.c_str();
  if (load_bytes != nullptr) *load_bytes = graphs[static_cast<size_t>(index)].load_bytes();
  return MM_OK;
}

mm_status mm_memory_stats_get(const mm_model* model, mm_memory_stats* stats, size_t struct_size) {
  const auto fill = [](const mm_model& handle, mm_memory_stats& full) {
    const ExpertCache& cache = handle.pipeline->cache();
    full.graph_bytes_loaded = handle.loader->bytes_loaded;
    full.max_experts_resident = cache.max_resident();
    full.planned_memory_bytes = static_cast<int64_t>(handle.loader->planned_bytes());
    full.weight_cache_bytes = static_cast<int64_t>(handle.packed_cache.bytes_held());
    full.parked_bytes_resident = mobile_moe::stats::resident_bytes(cache.parked_mappings());
    return MM_OK;
  };
  return get_struct("mm_memory_stats_get", model, stats, struct_size, fill);
}

int64_t mm_load_count(const mm_model* model) {
  Locked open(model);
  return open.model == nullptr ? 0 : open.model->loader->load_count();
}

mm_status mm_load_event_get(const mm_model* model, int64_t index, mm_load_event* event, size_t struct_size) {
  return get_struct("mm_load_event_get", model, event, struct_size, [&](const mm_model& handle, mm_load_event& full) {
    const Loader& loader = *handle.loader;
    const LoadEvent* kept = loader.event(index);
    if (kept == nullptr && index >= 0 && index < loader.load_count())
      return failed(MM_BAD_ARGUMENT, "mm_load_event_get: load " + std::to_string(index) + " is no longer kept (loads " +
                                         std::to_string(loader.first_kept()) + " on are: mm_load_settings." +
                                         "kept_loads; -1 keeps every one)");
    if (kept == nullptr)
      return failed(MM_BAD_ARGUMENT, "mm_load_event_get: load " + std::to_string(index) + " is out of range (" +
                                         std::to_string(loader.load_count()) + " loads so far: mm_load_count)");
    const LoadEvent& load = *kept;
    full.graph = load.graph;
    full.bytes = load.bytes;
    full.ms = load.ms;
    full.program_ms = load.program_ms, full.data_map_ms = load.data_map_ms, full.cache_check_ms = load.cache_check_ms;
    full.method_ms = load.method_ms, full.cache_record_ms = load.cache_record_ms, full.bring_in_ms = load.bring_in_ms;
    full.cache = load.cache;
    full.weights = load.weights;
    return MM_OK;
  });
}

int mm_loaded_graphs(const mm_model* model, int capacity, const char** names) {
  Locked open(model);
  if (open.model == nullptr) return 0;
  int count = 0;
  for (int expert : open.model->pipeline->cache().loaded_experts())
    for (const auto& graph : open.model->bundle.experts.at(static_cast<size_t>(expert))) {
      if (names != nullptr && count < capacity) names[count] = graph.name.c_str();
      ++count;
    }
  return count;
}

int mm_parked_experts(const mm_model* model, int capacity, int* experts) {
  Locked open(model);
  if (open.model == nullptr) return 0;
  const std::vector<int> parked = open.model->pipeline->cache().parked_experts();
  if (experts != nullptr)
    std::copy_n(parked.begin(), std::min<size_t>(parked.size(), static_cast<size_t>(std::max(capacity, 0))), experts);
  return static_cast<int>(parked.size());
}

mm_status mm_expert_unload(mm_model* model, int expert) {
  Locked open(model);
  if (open.model == nullptr) return not_open("mm_expert_unload", model);
  return guarded("mm_expert_unload", MM_RUNTIME_ERROR, [&] {
    check_expert(*open.model, expert);
    const auto threads = open.model->threads.scope();
    open.model->pipeline->cache().unload(expert);
  });
}

mm_status mm_expert_load(mm_model* model, int expert, int flags, double* load_ms) {
  Locked open(model);
  if (open.model == nullptr) return not_open("mm_expert_load", model);
  return guarded("mm_expert_load", MM_RUNTIME_ERROR, [&] {
    check_expert(*open.model, expert);
    if ((flags & ~MM_LOAD_COLD) != 0) throw UsageError("flags are 0 or MM_LOAD_COLD, not " + std::to_string(flags));
    const auto threads = open.model->threads.scope();
    bool hit = false;
    double ms = 0;
    open.model->pipeline->cache().get(expert, &hit, &ms, (flags & MM_LOAD_COLD) != 0);
    if (load_ms != nullptr) *load_ms = ms;
  });
}

mm_status mm_route_f32(mm_model* model, const float* chw, size_t count) {
  Locked open(model);
  if (open.model == nullptr) return not_open("mm_route_f32", model);
  return guarded("mm_route_f32", MM_RUNTIME_ERROR, [&] {
    if (open.model->bundle.kind != Kind::Split)
      throw UsageError(std::string("the bundle is ") + name(open.model->bundle.kind) + ": it has no router");
    std::vector<float> image = image_given(*open.model, chw, count);
    const auto threads = open.model->threads.scope();
    open.model->routed_tokens.clear();
    open.model->routed_tokens = open.model->pipeline->route(image);
  });
}

mm_status mm_expert_run(mm_model* model, int expert, double* ms) {
  Locked open(model);
  if (open.model == nullptr) return not_open("mm_expert_run", model);
  return guarded("mm_expert_run", MM_RUNTIME_ERROR, [&] {
    check_expert(*open.model, expert);
    if (open.model->routed_tokens.empty()) throw UsageError("no tokens to run on: call mm_route_f32 first");
    ExpertCache& cache = open.model->pipeline->cache();
    if (!cache.resident().count(expert))
      throw UsageError("expert " + std::to_string(expert) + " is not loaded: mm_expert_load it first");
    const auto threads = open.model->threads.scope();
    bool hit = false;
    double load_ms = 0;
    auto& graphs = cache.get(expert, &hit, &load_ms);  // a hit: the expert's graphs, most recently used now
    const auto start = Clock::now();
    open.model->pipeline->run_expert(expert, graphs, open.model->routed_tokens);
    if (ms != nullptr) *ms = ms_since(start);
  });
}

}  // extern "C"
