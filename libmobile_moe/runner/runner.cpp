// mobile_moe_runner: run a mobile-moe bundle (manifest.json + ExecuTorch graphs) the way a phone app would, and
// measure it. Prints ONE JSON object on stdout; errors go to stderr (exit 2: bad input, exit 1: runtime failure).
//
// Split bundles (k = 1): the router graph is loaded at start; per image the runner runs the router, picks the top-k
// experts from router_probs, loads only those expert graphs (an LRU of --cache-experts graphs; the least recently
// used is unloaded beyond it), runs them and returns the expert's logits. Dense, monolithic and whole bundles are one
// graph; a whole bundle (a per-token MoE) reports the experts each image used, from its expert_tokens output.
//
// Phases, in order (all in one process, so the numbers share one thread pool and one allocator):
//   1. cold load of the router (program open + method init, which is where XNNPACK packs weights)
//   2. routing pass: every input image once, in order, through the cache -> logits, experts, hits, per-image loads
//   3. warm-up, then --iterations timed end-to-end runs cycling over the images (cache as configured)
//   4. switch cost: for each expert, unload it, then time load + first run; then one more (warm) run
//
// The runner is a client of libmobile_moe like any app: it includes the public headers alone, mobile_moe.h (open,
// predict every image) and mobile_moe_measure.h (what an app never sees: the load settings it varies, expert
// switches step by step, each graph load, the expert cache), and links the library's code in (statically: the
// runner travels to a phone alone). Files: this one (options, inputs, statistics, measure() and its phases, main());
// json_writer.h and process_stats.h (its report, and what the OS says about its process).
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__linux__)  // Android too
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <new>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "json_writer.h"
#include "mobile_moe.h"
#include "mobile_moe_measure.h"
#include "process_stats.h"

namespace mobile_moe::runner {
namespace {

// Bad input (a flag, a file, a bundle the library refused): one line on stderr, exit 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// What the runner is doing, for the one line a fatal signal prints (written before the work, read in the handler).
char g_phase[256] = "starting";
void set_phase(const std::string& phase) { std::snprintf(g_phase, sizeof(g_phase), "%s", phase.c_str()); }

// ---------------------------------------------------------------------------------------------------------------
// Command line

// The measurement's own settings. Their defaults are bench's (mobile_moe.device_bench.round_settings.RoundSettings),
// kept equal here for a bundle run by hand on a phone; tests/device_bench/test_device_bench_native.py holds them equal.
// The library's options are mm_options itself, from mm_default_options: each flag named for its field, in its
// encoding (mobile_moe/library/options.py is their table), so what the runner leaves alone is what an app gets.
struct Options {
  std::string bundle;
  std::string input_path;  // raw float32, N x C x S x S; empty -> random images
  int random_images = 8;
  int iterations = 50;
  int warmup = 5;
  int switch_repeats = 2;  // times each expert's switch is measured
  unsigned seed = 0;
  std::string load_mode = "mmap";
  int workspace_sharing = -1;  // XNNPACK's workspace sharing mode for every load (mm_load_settings); -1: its default
  mm_options library = library_defaults();  // the library checks the values at mm_open; weight_cache_dir aside:
  std::optional<std::string> weight_cache_dir;  // --weight-cache-dir, which api_options points the library's at

  static mm_options library_defaults() {
    mm_options defaults;
    mm_default_options(&defaults);
    return defaults;
  }
};

// One line: every error the runner prints is one line on stderr.
const char* kUsage =
    "usage: mobile_moe_runner --bundle DIR [--input FILE.f32 | --random N] [--iterations N] [--warmup N] "
    "[--switch-repeats R] [--seed S] [--workspace-sharing none|model|global] [--load-mode mmap|file] "
    "[--threads T] [--cache-experts C] [--park-experts P] [--cache-margin D] [--weight-cache-dir DIR] "
    "[--weight-cache-limit-mib MIB] [--prefetch 0|1] (the library's options, in mm_options' encoding; each left out "
    "keeps mm_default_options' value)";

// --workspace-sharing: mm_load_settings.workspace_sharing, XNNPACK's WorkspaceSharingMode
// (backends/xnnpack/runtime/XNNWorkspaceManager.h: Disabled, PerModel, Global), by the position of its word.
int workspace_sharing_mode(const std::string& word) {
  const char* words[] = {"none", "model", "global"};
  for (int mode = 0; mode < 3; ++mode)
    if (word == words[mode]) return mode;
  throw UsageError("--workspace-sharing is none, model or global, not '" + word + "'");
}

// An integer flag value in [low, high]: the whole text must be the number ("5x", "", 1e3 and overflow are refused).
int to_int(const std::string& flag, const std::string& text, long low, long high) {
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || end == text.c_str() || *end != '\0' || errno == ERANGE)
    throw UsageError(flag + " needs an integer, got '" + text + "'");
  if (value < low || value > high)
    throw UsageError(flag + " " + text + " is out of range (" + std::to_string(low) + ".." + std::to_string(high) + ")");
  return static_cast<int>(value);
}

constexpr long kMaxFlag = 1000000;

// A number flag value in [low, high]: the whole text must be the number ("0.1x", "", "nan" are refused).
float to_float(const std::string& flag, const std::string& text, double low, double high) {
  char* end = nullptr;
  errno = 0;
  double value = std::strtod(text.c_str(), &end);
  if (text.empty() || end == text.c_str() || *end != '\0' || errno == ERANGE || !std::isfinite(value))
    throw UsageError(flag + " needs a number, got '" + text + "'");
  if (value < low || value > high)
    throw UsageError(flag + " " + text + " is out of range (" + std::to_string(low) + ".." + std::to_string(high) + ")");
  return static_cast<float>(value);
}

Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--bundle") options.bundle = next();
    else if (flag == "--input") options.input_path = next();
    else if (flag == "--random") options.random_images = to_int(flag, next(), 1, 100000);
    else if (flag == "--iterations") options.iterations = to_int(flag, next(), 1, kMaxFlag);
    else if (flag == "--warmup") options.warmup = to_int(flag, next(), 0, kMaxFlag);
    else if (flag == "--switch-repeats") options.switch_repeats = to_int(flag, next(), 0, kMaxFlag);
    else if (flag == "--seed") options.seed = static_cast<unsigned>(to_int(flag, next(), 0, INT_MAX));
    else if (flag == "--load-mode") options.load_mode = next();
    else if (flag == "--workspace-sharing") options.workspace_sharing = workspace_sharing_mode(next());
    else if (flag == "--threads") options.library.threads = to_int(flag, next(), INT_MIN, INT_MAX);
    else if (flag == "--cache-experts") options.library.cache_experts = to_int(flag, next(), INT_MIN, INT_MAX);
    else if (flag == "--park-experts") options.library.park_experts = to_int(flag, next(), INT_MIN, INT_MAX);
    else if (flag == "--cache-margin") options.library.cache_margin = to_float(flag, next(), -HUGE_VAL, HUGE_VAL);
    else if (flag == "--weight-cache-dir") options.weight_cache_dir = next();
    else if (flag == "--weight-cache-limit-mib")
      options.library.weight_cache_limit_mib = to_int(flag, next(), INT_MIN, INT_MAX);
    else if (flag == "--prefetch") options.library.prefetch = to_int(flag, next(), INT_MIN, INT_MAX);
    else if (flag == "--help" || flag == "-h") throw UsageError(kUsage);
    else throw UsageError("unknown flag " + flag + " (" + kUsage + ")");
  }
  if (options.bundle.empty()) throw UsageError(std::string("--bundle is required (") + kUsage + ")");
  if (options.load_mode != "mmap" && options.load_mode != "file") throw UsageError("--load-mode is mmap or file");
  return options;
}

// ---------------------------------------------------------------------------------------------------------------
// Inputs, statistics, memory

// The input images, fed one at a time as an app gets them: image i is read from --input (or drawn from its own seed
// with --random) into one buffer when it is asked for, so the process holds one image whatever N is and its peak RSS
// measures the model, not the test set (a 100-image file of 224 px images is 60 MB, more than a ViT-Ti/32 expert).
class ImageStream {
 public:
  ImageStream(const Options& options, int channels, int size)
      : path_(options.input_path), seed_(options.seed), per_image_(size_t(channels) * size_t(size) * size_t(size)) {
    buffer_.resize(per_image_);
    if (path_.empty()) {
      count_ = static_cast<size_t>(options.random_images);
      return;
    }
    const size_t image_bytes = per_image_ * sizeof(float);
    struct stat info {};
    if (stat(path_.c_str(), &info) != 0)
      throw UsageError("cannot read --input " + path_ + ": " + std::strerror(errno));
    if (!S_ISREG(info.st_mode)) throw UsageError("--input " + path_ + " is not a regular file");
    const auto bytes = static_cast<uint64_t>(info.st_size);
    if (bytes == 0 || bytes % image_bytes != 0)
      throw UsageError(path_ + " holds " + std::to_string(bytes) + " bytes, not a whole number of float32 images of " +
                       std::to_string(per_image_) + " values");
    count_ = static_cast<size_t>(bytes / image_bytes);
    file_.open(path_, std::ios::binary);
    if (!file_) throw UsageError("cannot read --input " + path_);
  }

  size_t size() const { return count_; }

  // Image `index % size()` in the one buffer (valid until the next call).
  std::vector<float>& at(size_t index) {
    index %= count_;
    if (path_.empty()) return draw(index);
    file_.seekg(static_cast<std::streamoff>(index * per_image_ * sizeof(float)));
    file_.read(reinterpret_cast<char*>(buffer_.data()), static_cast<std::streamsize>(per_image_ * sizeof(float)));
    if (!file_) throw UsageError("--input " + path_ + " changed while it was read (image " + std::to_string(index) + ")");
    return buffer_;
  }

 private:
  std::vector<float>& draw(size_t index) {
    std::seed_seq seeds{seed_, static_cast<unsigned>(index)};  // image i is the same whatever was drawn before it
    std::mt19937 generator(seeds);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& value : buffer_) value = normal(generator);
    return buffer_;
  }

  std::string path_;
  unsigned seed_;
  size_t per_image_;
  size_t count_ = 0;
  std::ifstream file_;
  std::vector<float> buffer_;
};

// Percentiles with linear interpolation between order statistics (numpy's default), so both sides agree.
double percentile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  double position = q / 100.0 * static_cast<double>(values.size() - 1);
  size_t below = static_cast<size_t>(position);
  size_t above = std::min(below + 1, values.size() - 1);
  return values[below] + (position - static_cast<double>(below)) * (values[above] - values[below]);
}

// A median, or null when nothing was timed (a dense bundle, --switch-repeats 0).
void write_median(json::Writer& out, const char* key, const std::vector<double>& values) {
  out.key(key);
  if (values.empty()) out.null();
  else out.value(percentile(values, 50));
}

void write_summary(json::Writer& out, const std::vector<double>& samples) {
  out.begin_object();
  out.key("p50").value(percentile(samples, 50));
  out.key("p90").value(percentile(samples, 90));
  out.key("p99").value(percentile(samples, 99));
  out.key("mean").value(std::accumulate(samples.begin(), samples.end(), 0.0) / static_cast<double>(samples.size()));
  out.key("min").value(*std::min_element(samples.begin(), samples.end()));
  out.key("max").value(*std::max_element(samples.begin(), samples.end()));
  out.key("samples").array(samples);
  out.end_object();
}

void write_bytes_or_null(json::Writer& out, const char* key, int64_t bytes) {
  out.key(key);
  if (bytes < 0) out.null();
  else out.value(bytes);
}

void write_memory(json::Writer& out, const stats::Memory& memory) {
  out.begin_object();
  write_bytes_or_null(out, "rss_bytes", memory.rss_bytes);
  write_bytes_or_null(out, "peak_rss_bytes", memory.peak_rss_bytes);
  write_bytes_or_null(out, "pss_bytes", memory.pss_bytes);
  out.end_object();
}

// ---------------------------------------------------------------------------------------------------------------
// measure(): the settings, then the four phases, each writing its part of the report in order

// The runner's library options as the C API takes them: the flags' values over mm_default_options'.
mm_options api_options(const Options& options) {
  mm_options api = options.library;
  if (options.weight_cache_dir) api.weight_cache_dir = options.weight_cache_dir->c_str();  // "": none
  return api;
}

// A C API call's failure as the runner's exit status: a bad option or bundle is bad input (2), the rest a runtime
// failure (1); the message is the library's.
void check(mm_status status) {
  if (status == MM_OK) return;
  std::string message = mm_last_error();
  if (message.rfind("mm_", 0) == 0 && message.find(": ") != std::string::npos)  // the C API's call: ours is the run
    message.erase(0, message.find(": ") + 2);
  if (status == MM_BAD_ARGUMENT || status == MM_BAD_BUNDLE) throw UsageError(message);
  if (status == MM_OUT_OF_MEMORY) throw std::bad_alloc();
  throw std::runtime_error(message);
}

using Model = std::unique_ptr<mm_model, decltype(&mm_close)>;

// 1. Open the bundle as an app does (the checks, then the cold load of the router or the single graph: program open
// + method init, where XNNPACK packs weights), with the load settings the runner varies.
Model open(const Options& options) {
  set_phase("opening the bundle " + options.bundle);
  const mm_options api = api_options(options);
  mm_load_settings load;
  mm_default_load_settings(&load);
  load.read_files = options.load_mode == "file" ? 1 : 0;
  load.workspace_sharing = options.workspace_sharing;
  load.kept_loads = -1;  // the report lists every load
  mm_model* opened = nullptr;
  check(mm_open_with(options.bundle.c_str(), &api, &load, &opened));
  return Model(opened, &mm_close);
}

// The handle's bundle and resolved options, and its memory so far (mobile_moe_measure.h).
mm_model_info model_info(mm_model* model) {
  mm_model_info info;
  check(mm_get_model_info(model, &info));
  return info;
}

mm_memory_stats memory_stats(mm_model* model) {
  mm_memory_stats stats;
  check(mm_get_memory_stats(model, &stats));
  return stats;
}

bool is_split(const mm_model_info& info) { return info.kind == MM_BUNDLE_SPLIT; }
bool caches_packed_weights(const mm_model_info& info) { return info.weight_cache_dir[0] != '\0'; }

// One image's answer and stage times, as the C API gives them: a row of the report.
struct Prediction {
  std::vector<float> logits;
  std::vector<int> experts;
  std::vector<float> gates;
  double router_ms = 0, expert_ms = 0, load_ms = 0, tail_ms = 0, load_wait_ms = 0, total_ms = 0;
  bool hit = true;
};

// One image through the C API, read back into the report's row.
Prediction predict(mm_model* model, const std::vector<float>& image) {
  check(mm_predict_f32(model, image.data(), image.size()));
  Prediction result;
  result.logits.resize(mm_logits(model, nullptr, 0));
  mm_logits(model, result.logits.data(), result.logits.size());
  const int experts = mm_experts(model, 0, nullptr, nullptr);
  result.experts.resize(static_cast<size_t>(experts));
  result.gates.resize(static_cast<size_t>(experts));
  mm_experts(model, experts, result.experts.data(), result.gates.data());
  mm_stage_times times;
  mm_last_times(model, &times);
  result.router_ms = times.router_ms, result.expert_ms = times.expert_ms, result.load_ms = times.load_ms;
  result.tail_ms = times.tail_ms, result.load_wait_ms = times.load_wait_ms, result.total_ms = times.total_ms;
  result.hit = times.cache_hit != 0;
  return result;
}

// Files under the bundle the process has held open, sampled after every step: the report shows that only the router
// and the chosen experts were ever opened.
struct OpenFiles {
  std::string bundle_dir;
  std::set<std::string> seen;

  void note() {
    for (const auto& file : stats::open_files_under(bundle_dir)) seen.insert(file);
  }
  std::vector<std::string> list() const { return std::vector<std::string>(seen.begin(), seen.end()); }
};

// What the graph loaded at start is called in load_ms and stages_ms: the router, or the single graph's kind.
std::string first_graph_key(const mm_model_info& info) { return is_split(info) ? "router" : info.kind_name; }

void write_run_settings(json::Writer& out, const Options& options, const mm_model_info& info, int num_experts,
                        size_t num_images) {
  out.key("runner").value("mobile-moe-native");
  out.key("bundle").value(info.bundle_dir);
  out.key("kind").value(info.kind_name);
  out.key("layout").value(info.layout);
  out.key("threads").value(static_cast<int64_t>(info.threads));
  out.key("load_mode").value(options.load_mode);
  out.key("workspace_sharing").value(static_cast<int64_t>(options.workspace_sharing));
  out.key("weight_cache").value(caches_packed_weights(info));
  out.key("weight_cache_dir").value(info.weight_cache_dir);
  out.key("num_experts").value(num_experts);
  out.key("top_k").value(info.top_k);
  out.key("cache_experts").value(info.cache_experts);
  out.key("park_experts").value(options.library.park_experts);
  out.key("cache_margin").value(static_cast<double>(options.library.cache_margin));
  out.key("prefetch").value(info.prefetch != 0);
  out.key("num_images").value(num_images);
  out.key("iterations").value(options.iterations);
  out.key("warmup").value(options.warmup);
}

// The cold load of the router (or the single graph) that opening did, and the memory after it.
void write_first_load(json::Writer& out, const mm_model_info& info) {
  out.key("load_ms").begin_object();
  out.key(first_graph_key(info)).value(info.resident_load_ms);
  out.end_object();
  out.key("memory_after_first_load");
  write_memory(out, stats::memory_now());
}

void write_image_row(json::Writer& out, const Prediction& result) {
  out.begin_object();
  out.key("experts").array(result.experts);
  out.key("gates").array(std::vector<double>(result.gates.begin(), result.gates.end()));
  out.key("logits").array(std::vector<double>(result.logits.begin(), result.logits.end()));
  out.key("router_ms").value(result.router_ms);
  out.key("expert_ms").value(result.expert_ms);
  out.key("load_ms").value(result.load_ms);
  out.key("tail_ms").value(result.tail_ms);
  out.key("load_wait_ms").value(result.load_wait_ms);
  out.key("total_ms").value(result.total_ms);
  out.key("cache_hit").value(result.hit);
  out.end_object();
}

// 2. Routing pass: each image once, in order, through the expert cache. Returns each expert's cold load time (its
// first load in this process).
std::map<int, double> routing_pass(json::Writer& out, mm_model* model, ImageStream& images, OpenFiles& files) {
  files.note();
  std::map<int, double> cold_expert_load_ms;
  int64_t bytes_before_routing = memory_stats(model).graph_bytes_loaded;
  out.key("images").begin_array();
  for (size_t i = 0; i < images.size(); ++i) {
    set_phase("predicting image " + std::to_string(i));
    Prediction result = predict(model, images.at(i));
    files.note();
    if (!result.hit && !cold_expert_load_ms.count(result.experts[0]))
      cold_expert_load_ms[result.experts[0]] = result.load_ms;
    write_image_row(out, result);
  }
  out.end_array();
  int64_t routing_bytes = memory_stats(model).graph_bytes_loaded - bytes_before_routing;
  out.key("routing_pass_graph_bytes_loaded").value(routing_bytes);
  std::vector<const char*> loaded(static_cast<size_t>(mm_loaded_graphs(model, 0, nullptr)));
  mm_loaded_graphs(model, static_cast<int>(loaded.size()), loaded.data());
  out.key("graphs_loaded_after_routing").array(std::vector<std::string>(loaded.begin(), loaded.end()));
  out.key("files_open_after_routing").array(stats::open_files_under(files.bundle_dir));
  out.key("memory_after_routing");
  write_memory(out, stats::memory_now());
  return cold_expert_load_ms;
}

// 3. Warm-up, then --iterations timed end-to-end runs cycling over the images (cache as configured).
void timed_runs(json::Writer& out, const Options& options, mm_model* model, const mm_model_info& info,
                ImageStream& images, OpenFiles& files) {
  set_phase("timing predictions");
  for (int i = 0; i < options.warmup; ++i) predict(model, images.at(static_cast<size_t>(i)));
  std::vector<double> total, router, expert, tail, loads;
  for (int i = 0; i < options.iterations; ++i) {
    Prediction result = predict(model, images.at(static_cast<size_t>(i)));
    total.push_back(result.total_ms);
    router.push_back(result.router_ms);
    expert.push_back(result.expert_ms);
    tail.push_back(result.tail_ms);
    if (!result.hit) loads.push_back(result.load_ms);
  }
  files.note();
  out.key("latency_ms");
  write_summary(out, total);
  out.key("stages_ms").begin_object();
  out.key(first_graph_key(info));
  write_summary(out, router);
  if (info.has_trunk_tail) {
    out.key("trunk_tail");
    write_summary(out, tail);
  }
  if (is_split(info)) {
    out.key("expert");
    write_summary(out, expert);
  }
  out.end_object();
  out.key("timed_expert_loads").value(loads.size());
  // The most experts resident (loaded, not parked) at one moment so far: with one expert cached, 1 (a prefetch
  // releases the evicted expert before it loads the next).
  const mm_memory_stats memory = memory_stats(model);
  out.key("max_experts_resident").value(static_cast<int64_t>(memory.max_experts_resident));
  // Experts parked now, and how much of their packed weights this process still maps in (0: all dropped).
  std::vector<int> parked(static_cast<size_t>(mm_parked_experts(model, 0, nullptr)));
  mm_parked_experts(model, static_cast<int>(parked.size()), parked.data());
  out.key("parked_experts").array(parked);
  write_bytes_or_null(out, "parked_packed_bytes_resident", memory.parked_bytes_resident);
  out.key("memory_after_warm");
  write_memory(out, stats::memory_now());
}

// One measured switch: an expert not loaded, loaded and run once, then run again (warm), with the load's parts.
struct SwitchSample {
  double total_ms = 0, load_ms = 0, first_run_ms = 0, warm_run_ms = 0;
  double program_ms = 0, data_map_ms = 0, cache_check_ms = 0, method_ms = 0, cache_record_ms = 0;
  // "parked" when the expert was parked (no load), "mapped" when every graph of it mapped its packed weights, else
  // "packed"
  std::string weights;
};

// Switches from the graph's own packed-weight cache file (warm after its first load; no cache without
// --weight-cache-dir), and, with a cache directory, from an empty one (cold: a scratch file each time).
struct SwitchTimes {
  std::vector<SwitchSample> serving, cold;
};

SwitchSample time_switch(mm_model* model, int expert, bool cold) {
  const std::string which = "expert " + std::to_string(expert) + (cold ? " from an empty packed-weight file" : "");
  check(mm_expert_unload(model, expert));
  const int64_t first_load = mm_load_count(model);
  auto start = Clock::now();
  SwitchSample sample;
  set_phase("timing a switch: loading " + which);
  check(mm_expert_load(model, expert, cold ? MM_LOAD_COLD : 0, &sample.load_ms));
  set_phase("timing a switch: running " + which);
  check(mm_expert_run(model, expert, &sample.first_run_ms));
  sample.total_ms = ms_since(start);
  check(mm_expert_run(model, expert, &sample.warm_run_ms));
  const int64_t loads = mm_load_count(model);
  sample.weights = loads == first_load ? "parked" : "mapped";
  for (int64_t i = first_load; i < loads; ++i) {
    mm_load_event event;
    check(mm_get_load_event(model, i, &event));
    sample.program_ms += event.program_ms;
    sample.data_map_ms += event.data_map_ms;
    sample.cache_check_ms += event.cache_check_ms;
    sample.method_ms += event.method_ms;
    sample.cache_record_ms += event.cache_record_ms;
    if (std::string(event.weights) != "mapped") sample.weights = "packed";
  }
  if (cold) check(mm_expert_unload(model, expert));  // the scratch file goes; the next switch loads the real one
  return sample;
}

// 4. Switch cost: for each expert, unload it, then time load + first run (what a phone pays when routing changes);
// then one more (warm) run. With a cache directory each expert is switched to from an empty cache first (cold), then
// from its own cache file. An expert first loaded here has its cold load recorded in cold_expert_load_ms.
SwitchTimes measure_switches(const Options& options, mm_model* model, const mm_model_info& info, ImageStream& images,
                             int num_experts, OpenFiles& files, std::map<int, double>& cold_expert_load_ms) {
  SwitchTimes times;
  if (!is_split(info)) return times;
  set_phase("timing expert switches");
  const std::vector<float>& image = images.at(0);
  check(mm_route_f32(model, image.data(), image.size()));  // real tokens, so the expert sees real input
  // Experts the images never chose are loaded once first (their cold load), so every timed switch from the cache
  // meets a file the expert's first load wrote, as serving does.
  for (int e = 0; e < num_experts && options.switch_repeats > 0; ++e) {
    if (cold_expert_load_ms.count(e)) continue;
    set_phase("loading expert " + std::to_string(e) + " for the first time");
    check(mm_expert_unload(model, e));
    check(mm_expert_load(model, e, 0, &cold_expert_load_ms[e]));
  }
  const bool cached = caches_packed_weights(info);
  for (int repeat = 0; repeat < options.switch_repeats; ++repeat) {
    for (int e = 0; e < num_experts; ++e) {
      if (cached) times.cold.push_back(time_switch(model, e, true));
      times.serving.push_back(time_switch(model, e, false));
      files.note();
    }
  }
  return times;
}

// The medians of a set of switches, and of each part of their loads; "other" is what the parts do not cover (the
// expert cache's bookkeeping), so every millisecond of a switch is in one part.
void write_switch_set(json::Writer& out, const std::vector<SwitchSample>& samples) {
  auto medians = [&](const char* key, auto field) {
    std::vector<double> values;
    for (const auto& sample : samples) values.push_back(field(sample));
    write_median(out, key, values);
  };
  std::vector<double> totals;
  for (const auto& sample : samples) totals.push_back(sample.total_ms);
  out.key("ms").array(totals);
  write_median(out, "median_ms", totals);
  medians("load_median_ms", [](const SwitchSample& s) { return s.load_ms; });
  medians("first_run_median_ms", [](const SwitchSample& s) { return s.first_run_ms; });
  medians("warm_expert_run_median_ms", [](const SwitchSample& s) { return s.warm_run_ms; });
  auto every = [&](auto keep) { return std::all_of(samples.begin(), samples.end(), keep); };
  out.key("weights");  // "packed" if any switch packed; "mapped" if every switch loaded from the cache or unparked
  if (samples.empty()) out.null();
  else if (every([](const SwitchSample& s) { return s.weights == "parked"; })) out.value("parked");
  else out.value(every([](const SwitchSample& s) { return s.weights != "packed"; }) ? "mapped" : "packed");
  out.key("parts_median_ms").begin_object();
  medians("program", [](const SwitchSample& s) { return s.program_ms; });
  medians("data_map", [](const SwitchSample& s) { return s.data_map_ms; });
  medians("cache_check", [](const SwitchSample& s) { return s.cache_check_ms; });
  medians("method_init", [](const SwitchSample& s) { return s.method_ms; });
  medians("cache_record", [](const SwitchSample& s) { return s.cache_record_ms; });
  medians("first_run", [](const SwitchSample& s) { return s.first_run_ms; });
  medians("other", [](const SwitchSample& s) {
    return s.total_ms - s.first_run_ms - s.program_ms - s.data_map_ms - s.cache_check_ms - s.method_ms -
           s.cache_record_ms;
  });
  out.end_object();
}

void write_switches(json::Writer& out, bool cached, const std::map<int, double>& cold_expert_load_ms,
                    const SwitchTimes& times) {
  out.key("expert_load_ms").begin_object();
  for (const auto& [e, ms] : cold_expert_load_ms) out.key(std::to_string(e)).value(ms);
  out.end_object();
  out.key("switch").begin_object();
  out.key("cache").value(cached ? "warm" : "off");
  write_switch_set(out, times.serving);
  out.key("cold");
  if (!cached) {
    out.null();
  } else {
    out.begin_object();
    write_switch_set(out, times.cold);
    out.end_object();
  }
  out.end_object();
}

// What loading each graph of the manifest reads (its program and its own weights file); then every load.
void write_graph_loads(json::Writer& out, mm_model* model, const mm_model_info& info, int64_t bytes_loaded) {
  out.key("graph_bytes").begin_object();
  for (int i = 0; i < info.graphs; ++i) {
    const char* graph = nullptr;
    int64_t bytes = 0;
    check(mm_graph(model, i, &graph, &bytes));
    out.key(graph).value(bytes);
  }
  out.end_object();
  out.key("graph_bytes_loaded_total").value(bytes_loaded);
  out.key("loads").begin_array();
  for (int64_t i = 0, loads = mm_load_count(model); i < loads; ++i) {
    mm_load_event event;
    check(mm_get_load_event(model, i, &event));
    out.begin_object();
    out.key("graph").value(event.graph);
    out.key("bytes").value(event.bytes);
    out.key("ms").value(event.ms);
    out.key("program_ms").value(event.program_ms);
    out.key("data_map_ms").value(event.data_map_ms);
    out.key("cache_check_ms").value(event.cache_check_ms);
    out.key("method_ms").value(event.method_ms);
    out.key("cache_record_ms").value(event.cache_record_ms);
    out.key("bring_in_ms").value(event.bring_in_ms);
    out.key("cache").value(event.cache);
    out.key("weights").value(event.weights);
    out.end_object();
  }
  out.end_array();
}

std::string measure(const Options& options) {
  const stats::Memory at_start = stats::memory_now();
  Model model = open(options);
  const mm_model_info info = model_info(model.get());
  ImageStream images(options, mm_input_channels(model.get()), mm_input_size(model.get()));
  int num_experts = is_split(info) || info.kind == MM_BUNDLE_WHOLE ? info.num_experts : 0;

  json::Writer out;
  out.begin_object();
  write_run_settings(out, options, info, num_experts, images.size());
  out.key("memory_at_start");
  write_memory(out, at_start);
  write_first_load(out, info);
  OpenFiles files{info.bundle_dir, {}};
  std::map<int, double> cold_expert_load_ms = routing_pass(out, model.get(), images, files);
  timed_runs(out, options, model.get(), info, images, files);
  // What the routing pass and the timed runs had open: by design only the router and the experts the images chose.
  out.key("files_opened").array(files.list());
  SwitchTimes switches = measure_switches(options, model.get(), info, images, num_experts, files, cold_expert_load_ms);
  write_switches(out, caches_packed_weights(info), cold_expert_load_ms, switches);
  const mm_memory_stats memory = memory_stats(model.get());  // nothing loads after the switches
  write_graph_loads(out, model.get(), info, memory.graph_bytes_loaded);
  out.key("files_opened_incl_switch").array(files.list());
  out.key("weight_cache_bytes").value(memory.weight_cache_bytes);  // 0 without a cache
  out.key("planned_memory_bytes").value(memory.planned_memory_bytes);
  out.key("memory_at_end");
  write_memory(out, stats::memory_now());
  out.end_object();
  return out.str();
}

// One line: newlines and other control characters in a message (a file name, a runtime log) become spaces.
std::string one_line(std::string text) {
  for (char& c : text)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  return text;
}

#if defined(__SANITIZE_ADDRESS__)
#define MOBILE_MOE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MOBILE_MOE_ASAN 1
#endif
#endif

// Last resort: a fatal signal (a crash inside the runtime that no check above caught) prints one line saying what the
// runner was doing, then dies of the same signal, so the caller still sees a crash (never a disguised success).
// Not installed under AddressSanitizer, whose own report is the point of that build.
[[maybe_unused]] void on_fatal_signal(int signal) {  // unused where MOBILE_MOE_ASAN leaves it out
  char line[512];
  int length = std::snprintf(line, sizeof(line), "mobile_moe_runner: crashed (signal %d) while %s\n", signal, g_phase);
  if (length > 0) {
    ssize_t ignored = write(STDERR_FILENO, line, static_cast<size_t>(std::min<int>(length, sizeof(line) - 1)));
    (void)ignored;
  }
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

bool g_debug = false;  // MOBILE_MOE_DEBUG=1

void print_log(mm_log_level level, const char* message, void*) {
  std::fprintf(stderr, "%c %s\n", "DIE"[level], message);
}

void install_fatal_signal_handlers() {
#ifndef MOBILE_MOE_ASAN
  static char alternate_stack[1 << 16];  // so a stack overflow can still print its line
  stack_t stack{};
  stack.ss_sp = alternate_stack;
  stack.ss_size = sizeof(alternate_stack);
  sigaltstack(&stack, nullptr);
  struct sigaction action {};
  action.sa_handler = on_fatal_signal;
  action.sa_flags = SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  for (int signal : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) sigaction(signal, &action, nullptr);
#endif
}

}  // namespace
}  // namespace mobile_moe::runner

int main(int argc, char** argv) {
  using namespace mobile_moe::runner;
  g_debug = std::getenv("MOBILE_MOE_DEBUG") != nullptr && std::string(std::getenv("MOBILE_MOE_DEBUG")) == "1";
#if defined(__linux__)
  // Die with the process that started us (bench, adb's shell): a bench killed by SIGKILL cannot stop its runner,
  // which would otherwise run its round to the end for nobody.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
  install_fatal_signal_handlers();
  // The library's log (ExecuTorch's with it) reaches stderr only with MOBILE_MOE_DEBUG=1: stderr stays the runner's
  // one line.
  if (g_debug) mm_log_set(print_log, nullptr);
  try {
    Options options = parse_options(argc, argv);
    const std::string report = measure(options) + "\n";
    // Where stdout is a file on a full disk, a report not written whole is a failure, never exit 0 with half of it
    if (std::fwrite(report.data(), 1, report.size(), stdout) != report.size() || std::fflush(stdout) != 0) {
      std::fprintf(stderr, "mobile_moe_runner: error: cannot write the report (%s)\n", std::strerror(errno));
      return 1;
    }
    return 0;
  } catch (const UsageError& error) {
    std::fprintf(stderr, "mobile_moe_runner: %s\n", one_line(error.what()).c_str());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "mobile_moe_runner: error: out of memory while %s\n", g_phase);
    return 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "mobile_moe_runner: error: %s\n", one_line(error.what()).c_str());
    return 1;
  }
}
