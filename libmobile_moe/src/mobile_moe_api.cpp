// libmobile_moe's C API (mobile_moe.h) over the on-device code: bundle_manifest.h checks the bundle, graph_loader.h
// loads graphs (one parsed program per family, packed-weight cache, one planned-memory arena) and graphs.h's Pipeline
// routes each image to its experts through the expert cache with parking and prefetch. This file only turns them into
// handles (model.h, handles.h), status codes and messages. measure_api.cpp adds what a benchmark reads and drives
// (mobile_moe_measure.h).
//
// Safe in an app's process (a multi-threaded JVM): nothing here forks, installs a signal handler or exits. A damaged
// bundle is refused by checks that run in-process before any graph is loaded: the manifest, every file's size and
// sha256 against it, and each ExecuTorch file's flatbuffer structure (flatbuffer_check.h), .ptd weights included;
// a weight cache folder remembers the files verified (bundle_manifest.h VerifiedFiles), so a cold start pays once.
#include "mobile_moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "bundle_manifest.h"
#include "errors.h"
#include "graph_loader.h"
#include "graphs.h"
#include "handles.h"
#include "model.h"
#include "options_schema.h"
#include "packed_cache.h"
#include "preprocess.h"
#include "runtime_log.h"
#include "struct_abi.h"
#include "thread_pool.h"

namespace {

using namespace mobile_moe::library;

constexpr int kMaxSide = 1 << 15;  // an app's photo: 32768 x 32768 at most (3 GB of RGB)
constexpr uint32_t kVersionNumber = MOBILE_MOE_VERSION;

// The defaults of mm_default_options, whole: the options table's (options_schema.h).
mm_options default_options() {
  mm_options options{};
  options.struct_size = sizeof(mm_options);
  options.threads = kOptionThreads.default_value;
  options.cache_experts = kOptionCacheExperts.default_value;
  options.park_experts = kOptionParkExperts.default_value;
  options.cache_margin = kOptionCacheMargin.default_value;
  options.weight_cache_dir = nullptr;
  options.weight_cache_limit_mib = kOptionWeightCacheLimitMib.default_value;
  options.prefetch = kOptionPrefetch.default_value;
  return options;
}

// An app's options as this library's: the fields its header had (its struct_size), the defaults for the rest.
mm_options options_given(const mm_options* given) {
  mm_options options = default_options();
  if (given == nullptr) return options;
  // The app's whole fields only: a size that ends inside a field (never one a header had) leaves that field default.
  const size_t first_end = offsetof(mm_options, threads) + sizeof(int);
  if (given->struct_size < first_end || given->struct_size > kMaxStructSize)
    throw UsageError("options->struct_size is " + std::to_string(given->struct_size) +
                     ": initialise the options with mm_default_options(&options) before setting them");
  copy_whole_fields(&options, *given, given->struct_size,
                    {first_end, offsetof(mm_options, cache_experts) + sizeof(int),
                     offsetof(mm_options, park_experts) + sizeof(int),
                     offsetof(mm_options, cache_margin) + sizeof(float),
                     offsetof(mm_options, weight_cache_dir) + sizeof(const char*),
                     offsetof(mm_options, weight_cache_limit_mib) + sizeof(int),
                     offsetof(mm_options, prefetch) + sizeof(int)});
  options.struct_size = sizeof(mm_options);
  return options;
}

// One numeric option within its bounds, or a line naming it and them.
template <typename Value>
void check_option(const NumericOption<Value>& option, Value value) {
  if (value >= option.low && value <= option.high) return;  // false for a NaN
  auto text = [](Value number) {
    std::ostringstream out;
    out << number;
    return out.str();
  };
  throw UsageError(std::string("options.") + option.name + " " + text(value) + " is out of range (" +
                   text(option.low) + ".." + text(option.high) + ")");
}

void check_options(const mm_options& options) {
  check_option(kOptionThreads, options.threads);
  check_option(kOptionCacheExperts, options.cache_experts);
  check_option(kOptionParkExperts, options.park_experts);
  check_option(kOptionCacheMargin, options.cache_margin);
  check_option(kOptionWeightCacheLimitMib, options.weight_cache_limit_mib);
  check_option(kOptionPrefetch, options.prefetch);
}

// The packed-weight folder the options name: the per-user default (NULL), none (""), or the app's, made if missing.
// The app chose it, so one it cannot use is refused (the per-user default is off instead: default_cache_dir); a path
// too long is refused before any of it is made.
std::string weight_cache_folder(const mm_options& options, std::string* off_because) {
  if (options.weight_cache_dir == nullptr) return default_cache_dir(off_because);
  const std::string dir = options.weight_cache_dir;
  if (dir.empty()) {
    *off_because = "options.weight_cache_dir is \"\"";
    return dir;
  }
  std::string why = cache_path_too_long(dir);
  if (why.empty() && !make_folders(dir)) why = std::string("cannot create it (") + std::strerror(errno) + ")";
  if (why.empty()) why = unusable_cache_folder(dir);
  if (!why.empty())
    throw UsageError("options.weight_cache_dir: " + why + "; pass a folder this process may write, with a shorter "
                     "path, or \"\" for none: " + dir);
  return dir;
}

// The k most probable classes of `logits` (softmax in double), most probable first; ties: the lower class index first
// (as predict --json's stable sort). -> how many were written: min(k, classes), 0 for k <= 0.
int top_classes(const std::vector<float>& logits, int k, int* classes, float* probabilities) {
  if (k <= 0 || logits.empty()) return 0;
  const double top = *std::max_element(logits.begin(), logits.end());
  std::vector<double> probs(logits.size());
  double total = 0;
  for (size_t i = 0; i < logits.size(); ++i) total += probs[i] = std::exp(static_cast<double>(logits[i]) - top);
  std::vector<int> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const int n = std::min<int>(k, static_cast<int>(order.size()));
  std::partial_sort(order.begin(), order.begin() + n, order.end(),
                    [&](int a, int b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
  for (int i = 0; i < n; ++i) {
    if (classes != nullptr) classes[i] = order[i];
    if (probabilities != nullptr) probabilities[i] = static_cast<float>(probs[order[i]] / total);
  }
  return n;
}

// The experts `last` took and their gates, at most `capacity` copied (either array may be NULL); -> how many it took.
int copy_experts(const Inference& last, int capacity, int* experts, float* gates) {
  const int n = static_cast<int>(last.experts.size());
  for (int i = 0; i < std::min(n, capacity); ++i) {
    if (experts != nullptr) experts[i] = last.experts[i];
    if (gates != nullptr) gates[i] = last.gates[i];
  }
  return n;
}

// The app's mm_result as far as its struct_size reaches (every field of the first version: the size an app built
// against an older header may not undercut), its arrays checked against the room it gives.
mm_result result_given(const mm_result* given) {
  if (given == nullptr) throw UsageError("result is NULL");
  const size_t first_version = offsetof(mm_result, cache_hit) + sizeof(int);
  if (given->struct_size < first_version || given->struct_size > kMaxStructSize)
    throw UsageError("result->struct_size is " + std::to_string(given->struct_size) +
                     ": initialise the result with mm_default_result(&result) before setting it");
  // The app's whole fields only (the first version's, which every app has, then each field a later header adds): a
  // library never reads an older app's padding as a field.
  mm_result result{};
  copy_whole_fields(&result, *given, given->struct_size, {first_version});
  if ((result.logits == nullptr && result.logits_capacity > 0) ||
      (result.classes == nullptr && result.top_k > 0) ||
      (result.experts == nullptr && result.gates == nullptr && result.experts_capacity > 0))
    throw UsageError("result has room for values but no array to write them to: set the pointer, or the room to 0");
  if (result.top_k < 0 || result.experts_capacity < 0)
    throw UsageError("result.top_k and result.experts_capacity are room, 0 or more");
  return result;
}

// The handle's last prediction into the app's arrays and `result`'s outputs, then `result` back to the app.
void write_result(const Inference& last, mm_result result, mm_result* given) {
  result.num_classes = static_cast<int>(last.logits.size());
  if (result.logits != nullptr)
    std::copy_n(last.logits.begin(), std::min(result.logits_capacity, last.logits.size()), result.logits);
  result.num_top = top_classes(last.logits, result.top_k, result.classes, result.probabilities);
  result.num_experts = copy_experts(last, result.experts_capacity, result.experts, result.gates);
  result.router_ms = last.router_ms, result.expert_ms = last.expert_ms, result.load_ms = last.load_ms;
  result.tail_ms = last.tail_ms, result.load_wait_ms = last.load_wait_ms, result.total_ms = last.total_ms;
  result.cache_hit = last.hit ? 1 : 0;
  copy_out(given, result, given->struct_size);
}

}  // namespace

extern "C" {

const char* mm_version(void) {
#define MOBILE_MOE_STRINGIFY_(x) #x
#define MOBILE_MOE_STRINGIFY(x) MOBILE_MOE_STRINGIFY_(x)
#define MOBILE_MOE_VERSION_TEXT                                                                   \
  "mobile-moe libmobile_moe " MOBILE_MOE_STRINGIFY(MOBILE_MOE_VERSION_MAJOR) "." MOBILE_MOE_STRINGIFY( \
      MOBILE_MOE_VERSION_MINOR) "." MOBILE_MOE_STRINGIFY(MOBILE_MOE_VERSION_PATCH)
#ifdef MOBILE_MOE_RUNTIME_ID
  return MOBILE_MOE_VERSION_TEXT ", " MOBILE_MOE_RUNTIME_ID;
#else
  return MOBILE_MOE_VERSION_TEXT;
#endif
}

int mm_version_number(void) { return static_cast<int>(kVersionNumber); }

void mm_options_init(mm_options* options, size_t struct_size) {
  if (options == nullptr || struct_size == 0) return;
  copy_out(options, default_options(), struct_size);
}

const char* mm_last_error(void) { return t_last_error.c_str(); }

const char* mm_default_weight_cache_dir(void) {
  static thread_local std::string folder;
  try {
    folder = default_cache_dir();
  } catch (...) {  // nothing crosses the C boundary: an environment the rule cannot read has no folder
    folder.clear();
  }
  return folder.c_str();
}

void mm_log_set(mm_log_callback callback, void* user_data) { set_library_log(callback, user_data); }

mm_status mm_open(const char* bundle_dir, const mm_options* options, mm_model** model) {
  return open_model("mm_open", bundle_dir, options, LoadSettings{}, model);
}

mm_status mm_prepare(const char* bundle_dir, const mm_options* options, mm_progress_callback progress,
                     void* user_data) {
  mm_options one_at_a_time{};
  mm_status status = guarded("mm_prepare", MM_BAD_ARGUMENT, [&] {
    one_at_a_time = options_given(options);
    one_at_a_time.cache_experts = -1, one_at_a_time.park_experts = 0;  // top_k experts in memory, the rest unloaded
    std::string off;
    if (weight_cache_folder(one_at_a_time, &off).empty())
      throw UsageError("packed weights are off (" + off + "): there is nothing to prepare ahead; pass a folder this "
                       "process may write");
  });
  mm_model* model = nullptr;
  LoadSettings every_load;
  every_load.kept_loads = -1;  // each graph's load event, however many experts
  if (status == MM_OK) status = open_model("mm_prepare", bundle_dir, &one_at_a_time, every_load, &model);
  if (status != MM_OK) return status;
  status = guarded("mm_prepare", MM_RUNTIME_ERROR, [&] {
    Locked open(model);
    const int experts = open.model->bundle.kind == Kind::Split ? open.model->bundle.num_experts : 0;
    if (progress != nullptr) progress(1, 1 + experts, user_data);  // mm_open's check and resident graphs
    const auto threads = open.model->threads.scope();
    for (int expert = 0; expert < experts; ++expert) {
      bool hit = false;
      double ms = 0;
      open.model->pipeline->cache().get(expert, &hit, &ms);
      if (progress != nullptr) progress(2 + expert, 1 + experts, user_data);
    }
    const Loader& loader = *open.model->loader;  // a graph the folder had no room for was packed in memory only
    for (int64_t load = 0; load < loader.load_count(); ++load)
      if (const LoadEvent* event = loader.event(load);
          event != nullptr && std::strcmp(event->cache, state_name(PackedCacheState::Off)) == 0)
        throw std::runtime_error(std::string("graph ") + event->graph + " could not be kept in " +
                                 open.model->packed_cache.dir() + " (no room: the log says why); free some space");
  });
  mm_close(model);
  return status;
}

void mm_close(mm_model* model) {
  std::shared_ptr<mm_model> closing = OpenHandles::instance().remove(model);
  if (!closing) return;
  std::lock_guard<std::mutex> lock(closing->mutex);  // a call running on it ends first
  closing->closed = true;
  closing->pipeline.reset();
  closing->loader.reset();
  closing->threads = HandleThreads();
}

int mm_num_classes(const mm_model* model) {
  Locked open(model);
  return open.model == nullptr ? 0 : static_cast<int>(open.model->bundle.class_names.size());
}

const char* mm_class_name(const mm_model* model, int index) {
  Locked open(model);
  if (open.model == nullptr || index < 0 || index >= static_cast<int>(open.model->bundle.class_names.size()))
    return nullptr;
  return open.model->bundle.class_names[static_cast<size_t>(index)].c_str();
}

int mm_input_channels(const mm_model* model) {
  Locked open(model);
  return open.model == nullptr ? 0 : open.model->bundle.image_shape.at(1);
}

int mm_input_size(const mm_model* model) {
  Locked open(model);
  return open.model == nullptr ? 0 : open.model->bundle.image_shape.at(3);
}

mm_status mm_predict_f32(mm_model* model, const float* chw, size_t count) {
  Locked open(model);
  if (open.model == nullptr) return not_open("mm_predict_f32", model);
  return guarded("mm_predict_f32", MM_RUNTIME_ERROR,
                 [&] { predict_locked(*open.model, image_given(*open.model, chw, count)); });
}

mm_status mm_preprocess_rgb8(const mm_model* model, const uint8_t* rgb, size_t length, int width, int height,
                             int row_stride, float* chw, size_t capacity) {
  Locked open(model);
  if (open.model == nullptr) return not_open("mm_preprocess_rgb8", model);
  if (chw == nullptr) return failed(MM_BAD_ARGUMENT, "mm_preprocess_rgb8: chw is NULL");
  const size_t needed = input_values(*open.model);
  if (capacity < needed)
    return failed(MM_BAD_ARGUMENT, "mm_preprocess_rgb8: room for " + std::to_string(capacity) + " values, not the " +
                                       std::to_string(needed) + " of C x S x S");
  return guarded("mm_preprocess_rgb8", MM_RUNTIME_ERROR, [&] {
    std::vector<float> values = preprocess_locked(*open.model, rgb, length, width, height, row_stride);
    std::copy(values.begin(), values.end(), chw);
  });
}

mm_status mm_predict_rgb8(mm_model* model, const uint8_t* rgb, size_t length, int width, int height,
                          int row_stride) {
  Locked open(model);
  if (open.model == nullptr) return not_open("mm_predict_rgb8", model);
  return guarded("mm_predict_rgb8", MM_RUNTIME_ERROR, [&] {
    predict_locked(*open.model, preprocess_locked(*open.model, rgb, length, width, height, row_stride));
  });
}

mm_status mm_predict_f32_into(mm_model* model, const float* chw, size_t count, mm_result* result) {
  Locked open(model);
  if (open.model == nullptr) return not_open("mm_predict_f32_into", model);
  return guarded("mm_predict_f32_into", MM_RUNTIME_ERROR, [&] {
    const mm_result asked = result_given(result);  // before anything runs
    predict_locked(*open.model, image_given(*open.model, chw, count));
    write_result(open.model->last, asked, result);
  });
}

mm_status mm_predict_rgb8_into(mm_model* model, const uint8_t* rgb, size_t length, int width, int height,
                               int row_stride, mm_result* result) {
  Locked open(model);
  if (open.model == nullptr) return not_open("mm_predict_rgb8_into", model);
  return guarded("mm_predict_rgb8_into", MM_RUNTIME_ERROR, [&] {
    const mm_result asked = result_given(result);  // before anything runs
    predict_locked(*open.model, preprocess_locked(*open.model, rgb, length, width, height, row_stride));
    write_result(open.model->last, asked, result);
  });
}

void mm_result_init(mm_result* result, size_t struct_size) {
  if (result == nullptr || struct_size < sizeof(size_t)) return;  // not even its size field
  copy_out(result, mm_result{}, struct_size);
}

size_t mm_logits(const mm_model* model, float* logits, size_t capacity) {
  Locked open(model);
  if (open.model == nullptr || !open.model->predicted) return 0;
  const auto& values = open.model->last.logits;
  if (logits != nullptr) std::copy_n(values.begin(), std::min(capacity, values.size()), logits);
  return values.size();
}

int mm_top_classes(const mm_model* model, int k, int* classes, float* probabilities) {
  Locked open(model);
  if (open.model == nullptr || !open.model->predicted) return 0;
  return top_classes(open.model->last.logits, k, classes, probabilities);
}

int mm_experts(const mm_model* model, int capacity, int* experts, float* gates) {
  Locked open(model);
  if (open.model == nullptr || !open.model->predicted) return 0;
  return copy_experts(open.model->last, capacity, experts, gates);
}

void mm_stage_times_get(const mm_model* model, mm_stage_times* times, size_t struct_size) {
  if (times == nullptr || struct_size == 0) return;
  mm_stage_times out{};
  Locked open(model);
  if (open.model != nullptr && open.model->predicted) {
    const Inference& last = open.model->last;
    out.router_ms = last.router_ms, out.expert_ms = last.expert_ms, out.load_ms = last.load_ms;
    out.tail_ms = last.tail_ms, out.load_wait_ms = last.load_wait_ms, out.total_ms = last.total_ms;
    out.cache_hit = last.hit ? 1 : 0;
  }
  copy_out(times, out, struct_size);
}

}  // extern "C"

size_t mobile_moe::library::input_values(const mm_model& model) {
  return static_cast<size_t>(model.bundle.image_shape.at(1)) * model.bundle.image_shape.at(3) *
         model.bundle.image_shape.at(3);
}

// An app's float image checked against the bundle (C x S x S values), as the handle's own copy: the pipeline feeds
// the graph from a buffer it may reuse.
std::vector<float> mobile_moe::library::image_given(const mm_model& model, const float* chw, size_t count) {
  if (chw == nullptr) throw UsageError("chw is NULL");
  const size_t expected = input_values(model);
  if (count != expected)
    throw UsageError(std::to_string(count) + " values, not the bundle's " + std::to_string(expected) +
                     " (C x S x S)");
  return std::vector<float>(chw, chw + count);
}

// One image (C x S x S) through an open, locked handle, on the handle's threads.
void mobile_moe::library::predict_locked(mm_model& model, std::vector<float> image) {
  const auto threads = model.threads.scope();
  model.predicted = false;
  model.last = model.pipeline->infer(image);
  model.predicted = true;
}

// An app's RGB8 buffer checked against its stated length, then preprocessed as the bundle's manifest says.
std::vector<float> mobile_moe::library::preprocess_locked(const mm_model& model, const uint8_t* rgb, size_t length,
                                                         int width, int height, int row_stride) {
  if (rgb == nullptr) throw UsageError("rgb is NULL");
  const int channels = model.bundle.image_shape.at(1);
  if (channels != 1 && channels != 3)
    throw UsageError("the bundle's images have " + std::to_string(channels) + " channels; RGB8 pixels become 3 (or "
                     "1, grey): give this bundle its input with mm_predict_f32");
  if (width < 1 || height < 1 || width > kMaxSide || height > kMaxSide || row_stride < 3 * width)
    throw UsageError(std::to_string(width) + " x " + std::to_string(height) + " pixels with a row stride of " +
                     std::to_string(row_stride) + " bytes: sides 1.." + std::to_string(kMaxSide) +
                     ", a stride of 3 * width or more");
  const uint64_t needed = uint64_t(height - 1) * uint64_t(row_stride) + uint64_t(3) * uint64_t(width);
  if (needed > length)
    throw UsageError(std::to_string(width) + " x " + std::to_string(height) + " pixels with a row stride of " +
                     std::to_string(row_stride) + " bytes need " + std::to_string(needed) + " bytes, and the " +
                     "buffer holds " + std::to_string(length) + "; pass the buffer's length and its real stride");
  return preprocess_rgb8(rgb, width, height, row_stride, channels, model.bundle.image_shape.at(3), model.bundle.input);
}

mm_status mobile_moe::library::open_model(const char* call, const char* bundle_dir, const mm_options* given,
                                         const LoadSettings& load, mm_model** model) {
  if (model == nullptr) return failed(MM_BAD_ARGUMENT, std::string(call) + ": model is NULL");
  *model = nullptr;
  if (bundle_dir == nullptr) return failed(MM_BAD_ARGUMENT, std::string(call) + ": bundle_dir is NULL");
  start_runtime();
  mm_options options = default_options();
  std::string cache_dir, cache_off;
  mm_status status = guarded(call, MM_BAD_ARGUMENT, [&] {
    options = options_given(given);
    check_options(options);
    cache_dir = weight_cache_folder(options, &cache_off);
  });
  if (status != MM_OK) return status;
  std::shared_ptr<mm_model> opened;
  status = guarded(call, MM_BAD_BUNDLE, [&] {
    opened = std::make_shared<mm_model>();
    opened->weight_cache_off = cache_off;
    // The manifest, then every file's size, sha256 and structure (once: remembered with the packed weights)
    opened->bundle = read_bundle(bundle_dir, cache_dir);
  });
  if (status != MM_OK) return status;
  status = guarded(call, MM_RUNTIME_ERROR, [&] {
    Bundle& bundle = opened->bundle;
    const bool split = bundle.kind == Kind::Split;
    int cache_experts = options.cache_experts == -1  ? std::max(bundle.top_k, 1)
                        : options.cache_experts == 0 ? std::max(bundle.num_experts, 1)
                                                     : options.cache_experts;
    if (split && cache_experts < bundle.top_k)
      throw UsageError("options.cache_experts (--cache-experts) " + std::to_string(cache_experts) +
                       " is fewer than the bundle's top_k, " +
                       std::to_string(bundle.top_k) + ": an image's experts run together; cache at least " +
                       std::to_string(bundle.top_k));
    if (!cache_dir.empty())
      opened->packed_cache = PackedCache(cache_dir, uint64_t(options.weight_cache_limit_mib) << 20);
    opened->threads = HandleThreads(options.threads);
    opened->loader = std::make_unique<Loader>(load.mode, opened->packed_cache, opened->threads,
                                              load.workspace_sharing,
                                              /*locate_packed_weights=*/options.park_experts != 0, load.kept_loads);
    opened->pipeline = std::make_unique<Pipeline>(bundle, *opened->loader, cache_experts, options.park_experts,
                                                  options.cache_margin, options.prefetch != 0);
    opened->cache_experts = split ? cache_experts : 0;  // a dense, monolithic or whole bundle loads no expert graph
    opened->prefetch = options.prefetch != 0 && prefetches(bundle);
    opened->resident_load_ms = opened->pipeline->load_resident();
  });
  if (status != MM_OK) return status;
  mm_model* handle = opened.get();
  status = guarded(call, MM_RUNTIME_ERROR, [&] { OpenHandles::instance().add(std::move(opened)); });
  if (status == MM_OK) *model = handle;
  return status;
}
