// The handle behind mobile_moe.h's opaque mm_model, and the one way to open it (mobile_moe_api.cpp). Private to the
// library: mobile_moe_api.cpp and measure_api.cpp (mobile_moe_measure.h) read it for their calls.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "bundle_manifest.h"
#include "graph_loader.h"
#include "graphs.h"
#include "mobile_moe.h"
#include "packed_cache.h"
#include "thread_pool.h"

namespace mobile_moe::library {

// How graphs are loaded, beyond mm_options (mobile_moe_measure.h's mm_load_settings); mm_open takes the defaults.
struct LoadSettings {
  LoadMode mode = LoadMode::Mmap;
  int workspace_sharing = -1;  // graph_loader.h Loader: XNNPACK's workspace sharing mode; -1 its default
  int kept_loads = static_cast<int>(kDefaultKeptLoads);  // the loads whose events mm_get_load_event reads; -1: all
};

// mm_open with `load`: the bundle checked (the manifest, then every file's size, sha256 and structure, remembered in
// the weight cache folder), the options checked against it, the router (or the single graph) loaded.
// `call`: the C API's call the app made (mm_open, mm_open_with), which its failures name.
mm_status open_model(const char* call, const char* bundle_dir, const mm_options* options, const LoadSettings& load,
                     mm_model** model);

// The C API's work on a handle it has locked: one image's prediction (on the handle's threads, from a copy of the
// image the pipeline may reuse), and an app's RGB8 buffer checked against its length, then preprocessed.
void predict_locked(mm_model& model, std::vector<float> image);
// The values of one image the handle takes: C x S x S.
size_t input_values(const mm_model& model);
// An app's float image of `count` values, checked against the bundle, as the handle's own copy.
std::vector<float> image_given(const mm_model& model, const float* chw, size_t count);
std::vector<float> preprocess_locked(const mm_model& model, const uint8_t* rgb, size_t length, int width, int height,
                                     int row_stride);

}  // namespace mobile_moe::library

// Declared in the order of its parts' lives: the graphs (pipeline, loader) go before the thread-pool lease they ran on.
struct mm_model {
  std::mutex mutex;  // the C API serialises calls on one handle (mobile_moe.h)
  mobile_moe::library::HandleThreads threads;
  mobile_moe::library::Bundle bundle;  // set once by open_model, never changed: the strings the API returns point here
  mobile_moe::library::PackedCache packed_cache;
  std::string weight_cache_off;  // why packed weights are off ("" when on): mm_model_info's weight_cache_off
  std::unique_ptr<mobile_moe::library::Loader> loader;
  std::unique_ptr<mobile_moe::library::Pipeline> pipeline;
  int cache_experts = 0;         // expert graphs kept loaded, as resolved from the options
  bool prefetch = false;         // a missed expert loads on a second thread (the option, where the bundle allows)
  double resident_load_ms = 0;   // opening's load of the router (+ shared parts), or of the single graph
  mobile_moe::library::Inference last;
  std::vector<float> routed_tokens;  // mm_route_f32's, for mm_expert_run (mobile_moe_measure.h); empty before it
  bool predicted = false;
  bool closed = false;  // by mm_close, which may find a call of another thread waiting on `mutex`
};
