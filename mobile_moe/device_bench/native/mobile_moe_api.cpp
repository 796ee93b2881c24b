// libmobile_moe's C API (mobile_moe.h) over the on-device code: bundle_manifest.h checks the bundle, graph_loader.h
// loads graphs (one parsed program per family, packed-weight cache, one planned-memory arena) and graphs.h's Pipeline
// routes each image to its experts through the expert cache with parking and prefetch. This file only turns them into
// handles (model.h), status codes and messages. The runner (runner.cpp) is a client: it opens and predicts through
// this file and times the same Pipeline.
//
// Safe in an app's process (a multi-threaded JVM): nothing here forks, installs a signal handler or exits. A damaged
// bundle is refused by checks that run in-process before any graph is loaded: the manifest, every file's size and
// sha256 against it, and each ExecuTorch file's flatbuffer structure (flatbuffer_check.h), .ptd weights included;
// a weight cache folder remembers the files verified (bundle_manifest.h VerifiedFiles), so a cold start pays once.
#include "mobile_moe.h"

#include <executorch/runtime/platform/runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <numeric>
#include <string>
#include <vector>

#include "bundle_manifest.h"
#include "errors.h"
#include "graph_loader.h"
#include "graphs.h"
#include "model.h"
#include "packed_cache.h"
#include "preprocess.h"
#include "thread_pool.h"

namespace {

using namespace mobile_moe::runner;

thread_local std::string t_last_error;
constexpr int kMaxSide = 1 << 15;  // an app's photo: 32768 x 32768 at most (3 GB of RGB)

mm_status failed(mm_status status, const std::string& message) {
  t_last_error = message;
  for (char& c : t_last_error)  // one line, as the runner prints it
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  return status;
}

// Every entry point's exceptions as a status and this thread's message: nothing is thrown across the C boundary.
template <typename Work>
mm_status guarded(mm_status runtime_status, Work work) {
  try {
    work();
    return MM_OK;
  } catch (const UsageError& error) {
    return failed(runtime_status == MM_RUNTIME_ERROR ? MM_BAD_ARGUMENT : runtime_status, error.what());
  } catch (const FileFault& error) {
    return failed(MM_BAD_BUNDLE, error.what());
  } catch (const std::bad_alloc&) {
    return failed(MM_OUT_OF_MEMORY, "out of memory");
  } catch (const std::exception& error) {
    return failed(MM_RUNTIME_ERROR, error.what());
  }
}

}  // namespace

extern "C" {

const char* mm_version(void) {
#ifdef MOBILE_MOE_RUNTIME_ID
  return "mobile-moe libmobile_moe 1, " MOBILE_MOE_RUNTIME_ID;
#else
  return "mobile-moe libmobile_moe 1";
#endif
}

void mm_default_options(mm_options* options) {
  if (options == nullptr) return;
  *options = mm_options{};
  options->threads = 1;
  options->cache_experts = 0;
  options->park_experts = -1;
  options->cache_margin = 0.0f;
  options->weight_cache_dir = nullptr;
  options->weight_cache_limit_mib = static_cast<int>(kDefaultPackedCacheLimit >> 20);
  options->prefetch = 1;
}

const char* mm_last_error(void) { return t_last_error.c_str(); }

mm_status mm_open(const char* bundle_dir, const mm_options* options, mm_model** model) {
  return open_model(bundle_dir, options, LoadSettings{}, model);
}

void mm_close(mm_model* model) { delete model; }

int mm_num_classes(const mm_model* model) {
  return model == nullptr ? 0 : static_cast<int>(model->bundle.class_names.size());
}

const char* mm_class_name(const mm_model* model, int index) {
  if (model == nullptr || index < 0 || index >= mm_num_classes(model)) return nullptr;
  return model->bundle.class_names[static_cast<size_t>(index)].c_str();
}

int mm_input_channels(const mm_model* model) { return model == nullptr ? 0 : model->bundle.image_shape.at(1); }
int mm_input_size(const mm_model* model) { return model == nullptr ? 0 : model->bundle.image_shape.at(3); }

mm_status mm_predict_f32(mm_model* model, const float* chw, size_t count) {
  if (model == nullptr || chw == nullptr) return failed(MM_BAD_ARGUMENT, "mm_predict_f32: model or chw is NULL");
  const size_t expected = static_cast<size_t>(mm_input_channels(model)) * mm_input_size(model) * mm_input_size(model);
  if (count != expected)
    return failed(MM_BAD_ARGUMENT, "mm_predict_f32: " + std::to_string(count) + " values, not the bundle's " +
                                       std::to_string(expected) + " (C x S x S)");
  return guarded(MM_RUNTIME_ERROR, [&] {
    std::vector<float> image(chw, chw + count);  // the pipeline feeds the graph from a buffer it may reuse
    model->predicted = false;
    model->last = model->pipeline->infer(image);
    model->predicted = true;
  });
}

mm_status mm_preprocess_rgb8(const mm_model* model, const uint8_t* rgb, int width, int height, int row_stride,
                             float* chw, size_t capacity) {
  if (model == nullptr || rgb == nullptr || chw == nullptr)
    return failed(MM_BAD_ARGUMENT, "mm_preprocess_rgb8: model, rgb or chw is NULL");
  if (width < 1 || height < 1 || width > kMaxSide || height > kMaxSide || row_stride < 3 * width)
    return failed(MM_BAD_ARGUMENT, "mm_preprocess_rgb8: " + std::to_string(width) + " x " + std::to_string(height) +
                                       " pixels with a row stride of " + std::to_string(row_stride) +
                                       " bytes: sides 1.." + std::to_string(kMaxSide) + ", a stride of 3 * width or more");
  const int channels = mm_input_channels(model), size = mm_input_size(model);
  const size_t needed = static_cast<size_t>(channels) * size * size;
  if (capacity < needed)
    return failed(MM_BAD_ARGUMENT, "mm_preprocess_rgb8: room for " + std::to_string(capacity) + " values, not the " +
                                       std::to_string(needed) + " of C x S x S");
  return guarded(MM_RUNTIME_ERROR, [&] {
    std::vector<float> values = preprocess_rgb8(rgb, width, height, row_stride, channels, size, model->bundle.input);
    std::copy(values.begin(), values.end(), chw);
  });
}

mm_status mm_predict_rgb8(mm_model* model, const uint8_t* rgb, int width, int height, int row_stride) {
  if (model == nullptr) return failed(MM_BAD_ARGUMENT, "mm_predict_rgb8: model is NULL");
  std::vector<float> chw;
  mm_status status = guarded(MM_RUNTIME_ERROR, [&] {
    chw.resize(static_cast<size_t>(mm_input_channels(model)) * mm_input_size(model) * mm_input_size(model));
  });
  if (status != MM_OK) return status;
  status = mm_preprocess_rgb8(model, rgb, width, height, row_stride, chw.data(), chw.size());
  return status != MM_OK ? status : mm_predict_f32(model, chw.data(), chw.size());
}

size_t mm_logits(const mm_model* model, float* logits, size_t capacity) {
  if (model == nullptr || !model->predicted) return 0;
  const auto& values = model->last.logits;
  if (logits != nullptr) std::copy_n(values.begin(), std::min(capacity, values.size()), logits);
  return values.size();
}

int mm_top_classes(const mm_model* model, int k, int* classes, float* probabilities) {
  if (model == nullptr || !model->predicted || k <= 0) return 0;
  const auto& logits = model->last.logits;
  const double top = *std::max_element(logits.begin(), logits.end());
  std::vector<double> probs(logits.size());
  double total = 0;
  for (size_t i = 0; i < logits.size(); ++i) total += probs[i] = std::exp(static_cast<double>(logits[i]) - top);
  std::vector<int> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const int n = std::min<int>(k, static_cast<int>(order.size()));
  // Most probable first; ties: the lower class index first (as predict --json's stable sort)
  std::partial_sort(order.begin(), order.begin() + n, order.end(),
                    [&](int a, int b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
  for (int i = 0; i < n; ++i) {
    if (classes != nullptr) classes[i] = order[i];
    if (probabilities != nullptr) probabilities[i] = static_cast<float>(probs[order[i]] / total);
  }
  return n;
}

int mm_experts(const mm_model* model, int capacity, int* experts, float* gates) {
  if (model == nullptr || !model->predicted) return 0;
  const int n = static_cast<int>(model->last.experts.size());
  for (int i = 0; i < std::min(n, capacity); ++i) {
    if (experts != nullptr) experts[i] = model->last.experts[i];
    if (gates != nullptr) gates[i] = model->last.gates[i];
  }
  return n;
}

void mm_last_times(const mm_model* model, mm_stage_times* times) {
  if (times == nullptr) return;
  *times = mm_stage_times{};
  if (model == nullptr || !model->predicted) return;
  const Inference& last = model->last;
  *times = mm_stage_times{last.router_ms, last.expert_ms, last.load_ms, last.tail_ms, last.load_wait_ms,
                          last.total_ms, last.hit ? 1 : 0};
}

}  // extern "C"

mm_status mobile_moe::runner::open_model(const char* bundle_dir, const mm_options* given, const LoadSettings& load,
                                         mm_model** model) {
  if (model == nullptr) return failed(MM_BAD_ARGUMENT, "mm_open: model is NULL");
  *model = nullptr;
  if (bundle_dir == nullptr) return failed(MM_BAD_ARGUMENT, "mm_open: bundle_dir is NULL");
  mm_options options;
  mm_default_options(&options);
  if (given != nullptr) options = *given;
  if (options.threads < 0 || options.threads > 1024)
    return failed(MM_BAD_ARGUMENT, "threads " + std::to_string(options.threads) + " is out of range (0..1024)");
  if (options.cache_experts < 0 || options.park_experts < -1 || !(options.cache_margin >= 0.0f) ||
      options.cache_margin > 1.0f || options.weight_cache_limit_mib < 1)
    return failed(MM_BAD_ARGUMENT, "cache_experts >= 0, park_experts >= -1, cache_margin 0..1 and "
                                   "weight_cache_limit_mib >= 1, please");
  std::unique_ptr<mm_model> opened(new (std::nothrow) mm_model());
  if (!opened) return failed(MM_OUT_OF_MEMORY, "out of memory");
  mm_status status = guarded(MM_BAD_BUNDLE, [&] {
    executorch::runtime::runtime_init();
    // The manifest, then every file's size, sha256 and structure (once: remembered with the packed weights)
    const bool cached = options.weight_cache_dir != nullptr && options.weight_cache_dir[0] != '\0';
    opened->bundle = read_bundle(bundle_dir, cached ? options.weight_cache_dir : "");
  });
  if (status != MM_OK) return status;
  return guarded(MM_RUNTIME_ERROR, [&] {
    Bundle& bundle = opened->bundle;
    const bool split = bundle.kind == Kind::Split;
    int cache_experts = options.cache_experts == 0 ? std::max(bundle.num_experts, 1) : options.cache_experts;
    if (split && cache_experts < bundle.top_k)
      throw UsageError("cache_experts (--cache-experts) " + std::to_string(cache_experts) +
                       " is fewer than the bundle's top_k, " + std::to_string(bundle.top_k) +
                       ": an image's experts run together; cache at least " + std::to_string(bundle.top_k));
    if (options.weight_cache_dir != nullptr && options.weight_cache_dir[0] != '\0')
      opened->packed_cache = PackedCache(options.weight_cache_dir, uint64_t(options.weight_cache_limit_mib) << 20);
    if (options.threads > 0) set_threads(options.threads);
    opened->loader = std::make_unique<Loader>(load.mode, opened->packed_cache, load.workspace_sharing,
                                              /*locate_packed_weights=*/options.park_experts != 0);
    opened->pipeline = std::make_unique<Pipeline>(bundle, *opened->loader, cache_experts, options.park_experts,
                                                  options.cache_margin, options.prefetch != 0);
    opened->cache_experts = cache_experts;
    opened->resident_load_ms = opened->pipeline->load_resident();
    *model = opened.release();
  });
}

