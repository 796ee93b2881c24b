// mobile_moe_runner: run a mobile-moe bundle (manifest.json + ExecuTorch graphs) the way a phone app would, and
// measure it. Prints ONE JSON object on stdout; errors go to stderr (exit 2: bad input, exit 1: runtime failure).
//
// Split bundles (k = 1): the router graph is loaded at start; per image the runner runs the router, picks the top-k
// experts from router_probs, loads only those expert graphs (an LRU of --cache-experts graphs; the least recently
// used is unloaded beyond it), runs them and returns the expert's logits. Dense and monolithic bundles are one graph.
//
// Phases, in order (all in one process, so the numbers share one thread pool and one allocator):
//   1. cold load of the router (program open + method init, which is where XNNPACK packs weights)
//   2. routing pass: every input image once, in order, through the cache -> logits, experts, hits, per-image loads
//   3. warm-up, then --iterations timed end-to-end runs cycling over the images (cache as configured)
//   4. switch cost: for each expert, unload it, then time load + first run; then one more (warm) run
#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/backend/options.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <climits>
#include <list>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "json_reader.h"
#include "json_writer.h"
#include "process_stats.h"

// The wheel ships libexecutorch_threadpool but not its header; these two declarations match the library's symbols
// (executorch/extension/threadpool/threadpool.h) and are all the runner needs to pin the thread count.
namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  size_t get_thread_count() const;
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool

using executorch::extension::Module;
using executorch::runtime::EValue;
namespace json = mobile_moe::json;
namespace stats = mobile_moe::stats;

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Bad input (exit 2) vs. a runtime failure (exit 1), so the Python side can tell the user which it was.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---------------------------------------------------------------------------------------------------------------
// Command line

struct Options {
  std::string bundle;
  std::string input_path;  // raw float32, N x C x S x S; empty -> random images
  int random_images = 8;
  int iterations = 50;
  int warmup = 5;
  int threads = 1;
  int cache_experts = -1;  // -1: all experts
  int switch_repeats = 2;  // times each expert's switch is measured
  unsigned seed = 0;
  bool weight_cache = false;   // XNNPACK's packed-weight cache shared across delegate instances
  std::string load_mode = "mmap";
};

const char* kUsage =
    "usage: mobile_moe_runner --bundle DIR [--input FILE.f32 | --random N] [--iterations N] [--warmup N]\n"
    "       [--threads T] [--cache-experts C] [--switch-repeats R] [--seed S] [--weight-cache] [--load-mode mmap|file]";

int to_int(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  long value = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0') throw UsageError(flag + " needs an integer, got '" + text + "'");
  return static_cast<int>(value);
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
    else if (flag == "--random") options.random_images = to_int(flag, next());
    else if (flag == "--iterations") options.iterations = to_int(flag, next());
    else if (flag == "--warmup") options.warmup = to_int(flag, next());
    else if (flag == "--threads") options.threads = to_int(flag, next());
    else if (flag == "--cache-experts") options.cache_experts = to_int(flag, next());
    else if (flag == "--switch-repeats") options.switch_repeats = to_int(flag, next());
    else if (flag == "--seed") options.seed = static_cast<unsigned>(to_int(flag, next()));
    else if (flag == "--weight-cache") options.weight_cache = true;
    else if (flag == "--load-mode") options.load_mode = next();
    else if (flag == "--help" || flag == "-h") throw UsageError(kUsage);
    else throw UsageError("unknown flag " + flag + "\n" + kUsage);
  }
  if (options.bundle.empty()) throw UsageError(std::string("--bundle is required\n") + kUsage);
  if (options.iterations < 1) throw UsageError("--iterations must be at least 1");
  if (options.warmup < 0) throw UsageError("--warmup must be 0 or more");
  if (options.threads < 1) throw UsageError("--threads must be at least 1");
  if (options.random_images < 1) throw UsageError("--random must be at least 1");
  if (options.load_mode != "mmap" && options.load_mode != "file") throw UsageError("--load-mode is mmap or file");
  return options;
}

// ---------------------------------------------------------------------------------------------------------------
// Bundle (manifest.json)

struct Graph {
  std::string name, role, file, path;
  int expert = -1;
  int64_t bytes = 0;
  std::vector<std::vector<int32_t>> input_shapes;
};

// The manifest's composition, resolved to files. Layouts (export/graphs.py):
//   expert-paths (k = 1): router; expert e = one graph (tokens, gate) -> logits
//   per-block (any k):    router, per MoE block a shared graph (tokens -> residual, normed), head (tokens -> logits)
//                         loaded at open; expert e = one MLP graph per block (normed -> delta), x = residual + g * delta
//   dense / monolithic:   one graph, images -> logits (+ router_probs)
struct Bundle {
  std::string dir;     // real path
  std::string kind;    // "split" (router + experts), "dense", "monolithic"
  std::string layout;  // "expert-paths", "per-block", "dense", "monolithic"
  int num_experts = 0, top_k = 1;
  bool renormalize_gates = false;
  std::vector<int32_t> image_shape;  // (1, C, S, S)
  Graph single;                      // dense / monolithic
  Graph router;
  std::vector<Graph> shared;                 // per-block: one per MoE block
  Graph head;                                // per-block
  std::vector<std::vector<Graph>> experts;   // expert -> its graphs (one, or one per block)
  const Graph& first() const { return kind == "split" ? router : single; }
  int64_t expert_bytes(int e) const {
    int64_t total = 0;
    for (const auto& graph : experts[e]) total += graph.bytes;
    return total;
  }
};

std::string read_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw UsageError("cannot read " + path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

std::string real_path(const std::string& path) {
  char resolved[PATH_MAX];
  if (realpath(path.c_str(), resolved) == nullptr) return "";
  return resolved;
}

Graph graph_from(const json::Value& entry, const std::string& dir) {
  Graph graph;
  graph.name = entry.at("name").str();
  graph.role = entry.at("role").str();
  graph.file = entry.at("file").str();
  graph.expert = entry.has("expert") && !entry.at("expert").is_null() ? static_cast<int>(entry.at("expert").integer()) : -1;
  graph.path = real_path(dir + "/" + graph.file);
  if (graph.path.empty()) throw UsageError("graph file " + graph.file + " named in the manifest is missing");
  // The manifest must not point outside the bundle (a bundle is untrusted input on a phone).
  if (graph.path.compare(0, dir.size() + 1, dir + "/") != 0)
    throw UsageError("graph file " + graph.file + " leaves the bundle directory; refusing it");
  std::ifstream file(graph.path, std::ios::binary | std::ios::ate);
  graph.bytes = static_cast<int64_t>(file.tellg());
  for (const auto& input : entry.at("inputs").array) {
    std::vector<int32_t> shape;
    for (const auto& size : input.at("shape").array) shape.push_back(static_cast<int32_t>(size.integer()));
    graph.input_shapes.push_back(shape);
  }
  return graph;
}

Bundle read_bundle(const std::string& path) {
  Bundle bundle;
  bundle.dir = real_path(path);
  if (bundle.dir.empty()) throw UsageError("bundle directory " + path + " does not exist");
  json::Value manifest;
  try {
    manifest = json::parse(read_file(bundle.dir + "/manifest.json"));
  } catch (const UsageError&) {
    throw UsageError(path + " has no manifest.json: export a bundle with `mobile-moe export`");
  } catch (const std::runtime_error& error) {
    throw UsageError(path + "/manifest.json is not valid JSON: " + error.what());
  }
  if (!manifest.has("format") || manifest.at("format").str() != "mobile-moe-bundle")
    throw UsageError(path + "/manifest.json is not a mobile-moe bundle manifest");
  if (manifest.at("backend").str() != "executorch")
    throw UsageError("the native runner runs ExecuTorch bundles; " + path + " is a " + manifest.at("backend").str() +
                     " bundle");
  for (const auto& size : manifest.at("input").at("shape").array)
    bundle.image_shape.push_back(static_cast<int32_t>(size.integer()));
  if (manifest.has("num_experts") && !manifest.at("num_experts").is_null())
    bundle.num_experts = static_cast<int>(manifest.at("num_experts").integer());
  if (manifest.has("top_k") && !manifest.at("top_k").is_null())
    bundle.top_k = static_cast<int>(manifest.at("top_k").integer());
  const auto& model = manifest.at("model");
  bundle.renormalize_gates = model.has("renormalize_gates") && model.at("renormalize_gates").truthy();

  std::map<std::string, Graph> graphs;
  for (const auto& entry : manifest.at("graphs").array) {
    Graph graph = graph_from(entry, bundle.dir);
    graphs[graph.name] = graph;
  }
  auto named = [&](const json::Value& name) -> const Graph& {
    auto found = graphs.find(name.str());
    if (found == graphs.end()) throw UsageError("the composition names graph " + name.str() + ", absent from graphs");
    return found->second;
  };
  bundle.layout = manifest.has("composition") && !manifest.at("composition").is_null()
                      ? manifest.at("composition").at("layout").str()
                      : "";
  if (bundle.layout.empty()) {  // no composition: infer it from the roles
    for (const auto& [name, graph] : graphs) {
      if (graph.role == "router") bundle.layout = "expert-paths";
      if (graph.role == "dense" || graph.role == "monolithic") bundle.layout = graph.role;
    }
  }
  if (bundle.layout == "dense" || bundle.layout == "monolithic") {
    for (const auto& [name, graph] : graphs)
      if (graph.role == bundle.layout) bundle.single = graph;
    if (bundle.single.path.empty()) throw UsageError("the manifest has no " + bundle.layout + " graph");
    bundle.kind = bundle.layout;
  } else if (bundle.layout == "expert-paths" || bundle.layout == "per-block") {
    bundle.kind = "split";
    const json::Value* composition = manifest.has("composition") && !manifest.at("composition").is_null()
                                         ? &manifest.at("composition")
                                         : nullptr;
    bundle.experts.resize(bundle.num_experts);
    if (bundle.layout == "per-block") {
      if (composition == nullptr) throw UsageError("a per-block bundle needs its composition in the manifest");
      bundle.router = named(composition->at("router"));
      bundle.head = named(composition->at("head"));
      for (const auto& block : composition->at("blocks").array) {
        bundle.shared.push_back(named(block.at("shared")));
        if (static_cast<int>(block.at("experts").array.size()) != bundle.num_experts)
          throw UsageError("a block of the composition does not name one graph per expert");
        for (int e = 0; e < bundle.num_experts; ++e) bundle.experts[e].push_back(named(block.at("experts").at(e)));
      }
    } else {
      if (bundle.top_k != 1) throw UsageError("the expert-paths layout needs k = 1; this bundle has k > 1");
      for (const auto& [name, graph] : graphs) {
        if (graph.role == "router") bundle.router = graph;
        if (graph.role == "expert" && graph.expert >= 0 && graph.expert < bundle.num_experts)
          bundle.experts[graph.expert] = {graph};
      }
    }
    if (bundle.router.path.empty()) throw UsageError("the manifest has no router graph");
    for (int e = 0; e < bundle.num_experts; ++e)
      if (bundle.experts[e].empty()) throw UsageError("expert " + std::to_string(e) + " has no graph in the manifest");
  } else {
    throw UsageError("unknown composition layout '" + bundle.layout + "'");
  }
  if (bundle.image_shape.size() != 4) throw UsageError("input.shape in the manifest must be (1, C, S, S)");
  return bundle;
}

// ---------------------------------------------------------------------------------------------------------------
// Graphs: load, run, and an LRU of expert graphs

struct LoadEvent {
  std::string graph;
  int64_t bytes;
  double ms;          // total
  double program_ms;  // open the file, parse and verify the program (mmap: pages come in lazily)
  double method_ms;   // initialise the forward method: delegate init, i.e. XNNPACK builds its runtime and packs weights
};

class Loader {
 public:
  explicit Loader(const std::string& mode)
      : mode_(mode == "file" ? Module::LoadMode::File : Module::LoadMode::Mmap) {}

  // Open the program and initialise its forward method: the delegate (XNNPACK) packs its weights here.
  std::unique_ptr<Module> load(const Graph& graph) {
    auto start = Clock::now();
    auto module = std::make_unique<Module>(graph.path, mode_);
    auto status = module->load();
    double program_ms = ms_since(start);
    auto method_start = Clock::now();
    if (status == executorch::runtime::Error::Ok) status = module->load_forward();
    if (status != executorch::runtime::Error::Ok)
      throw std::runtime_error("loading " + graph.file + " failed (ExecuTorch error " +
                               std::to_string(static_cast<int>(status)) + ")");
    events.push_back({graph.name, graph.bytes, ms_since(start), program_ms, ms_since(method_start)});
    bytes_loaded += graph.bytes;
    return module;
  }

  std::vector<LoadEvent> events;
  int64_t bytes_loaded = 0;

 private:
  Module::LoadMode mode_;
};

// Run forward on float32 inputs; copy the float32 outputs out (the module's output buffers are reused on the next run).
std::vector<std::vector<float>> run(Module& module, std::vector<std::pair<float*, std::vector<int32_t>>> inputs) {
  std::vector<executorch::extension::TensorPtr> tensors;
  std::vector<EValue> values;
  for (auto& [data, shape] : inputs) {
    tensors.push_back(executorch::extension::from_blob(data, shape));
    values.emplace_back(*tensors.back());
  }
  auto result = module.forward(values);
  if (!result.ok())
    throw std::runtime_error("forward failed (ExecuTorch error " + std::to_string(static_cast<int>(result.error())) +
                             ")");
  std::vector<std::vector<float>> outputs;
  for (const auto& value : *result) {
    const auto& tensor = value.toTensor();
    const float* data = tensor.const_data_ptr<float>();
    outputs.emplace_back(data, data + tensor.numel());
  }
  return outputs;
}

class ExpertCache {
 public:
  ExpertCache(const Bundle& bundle, Loader& loader, int capacity)
      : bundle_(bundle), loader_(loader), capacity_(capacity) {}

  // The expert's modules (one, or one per block), loading them (and evicting the least recently used expert beyond
  // capacity) when absent.
  std::vector<std::unique_ptr<Module>>& get(int expert, bool* hit, double* load_ms) {
    auto found = modules_.find(expert);
    *hit = found != modules_.end();
    *load_ms = 0.0;
    if (*hit) {
      order_.remove(expert);
      order_.push_front(expert);
      return found->second;
    }
    while (static_cast<int>(modules_.size()) >= capacity_) unload(order_.back());
    auto start = Clock::now();
    auto& modules = modules_[expert];
    for (const auto& graph : bundle_.experts[expert]) modules.push_back(loader_.load(graph));
    *load_ms = ms_since(start);
    order_.push_front(expert);
    ever_loaded_.insert(expert);
    return modules;
  }

  void unload(int expert) {
    modules_.erase(expert);
    order_.remove(expert);
  }

  std::vector<std::string> loaded_names() const {
    std::vector<std::string> names;
    for (int expert : order_)
      for (const auto& graph : bundle_.experts[expert]) names.push_back(graph.name);
    return names;
  }
  const std::set<int>& ever_loaded() const { return ever_loaded_; }

 private:
  const Bundle& bundle_;
  Loader& loader_;
  int capacity_;
  std::map<int, std::vector<std::unique_ptr<Module>>> modules_;
  std::list<int> order_;  // most recently used first
  std::set<int> ever_loaded_;
};

// ---------------------------------------------------------------------------------------------------------------
// The pipeline: one image end to end

struct Inference {
  std::vector<float> logits;
  std::vector<int> experts;
  std::vector<float> gates;
  double router_ms = 0, expert_ms = 0, load_ms = 0, total_ms = 0;
  bool hit = true;
};

// Top-k of the router probabilities (ties -> lower index), gates optionally renormalised as the model does.
void pick_experts(const std::vector<float>& probs, int k, bool renormalize, Inference& out) {
  std::vector<int> order(probs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return probs[a] > probs[b]; });
  float total = 0;
  for (int i = 0; i < k; ++i) {
    out.experts.push_back(order[i]);
    out.gates.push_back(probs[order[i]]);
    total += probs[order[i]];
  }
  if (renormalize)
    for (auto& gate : out.gates) gate /= total;
}

class Pipeline {
 public:
  Pipeline(const Bundle& bundle, Loader& loader, int cache_experts)
      : bundle_(bundle), loader_(loader), cache_(bundle, loader, cache_experts) {}

  // Everything loaded at open: the router (+ per-block shared parts and head), or the single graph.
  double load_resident() {
    auto start = Clock::now();
    first_ = loader_.load(bundle_.first());
    for (const auto& graph : bundle_.shared) shared_.push_back(loader_.load(graph));
    if (bundle_.layout == "per-block") head_ = loader_.load(bundle_.head);
    return ms_since(start);
  }

  Inference infer(float* image) {
    Inference out;
    auto start = Clock::now();
    auto outputs = run(*first_, {{image, bundle_.first().input_shapes.at(0)}});
    if (bundle_.kind != "split") {
      out.logits = outputs.at(0);
      if (bundle_.kind == "monolithic") pick_experts(outputs.at(1), bundle_.top_k, bundle_.renormalize_gates, out);
      out.total_ms = out.router_ms = ms_since(start);
      return out;
    }
    std::vector<float>& tokens = outputs.at(0);
    pick_experts(outputs.at(1), bundle_.top_k, bundle_.renormalize_gates, out);
    out.router_ms = ms_since(start);

    auto expert_start = Clock::now();
    std::vector<std::vector<std::unique_ptr<Module>>*> chosen;
    for (int expert : out.experts) {
      bool hit = false;
      double load_ms = 0;
      chosen.push_back(&cache_.get(expert, &hit, &load_ms));
      out.hit = out.hit && hit;
      out.load_ms += load_ms;
    }
    out.logits = bundle_.layout == "per-block" ? run_blocks(tokens, chosen, out.gates)
                                               : run_path(*chosen[0]->at(0), out.experts[0], tokens, out.gates[0]);
    out.expert_ms = ms_since(expert_start) - out.load_ms;
    out.total_ms = ms_since(start);
    return out;
  }

  // The router's outputs (tokens, router_probs) for one image.
  std::vector<std::vector<float>> route(float* image) { return run(*first_, {{image, bundle_.router.input_shapes.at(0)}}); }

  // One chosen expert's computation on given tokens: what an expert switch has to wait for after loading.
  std::vector<float> run_expert(int expert, std::vector<std::unique_ptr<Module>>& modules, std::vector<float> tokens) {
    std::vector<std::vector<std::unique_ptr<Module>>*> chosen{&modules};
    return bundle_.layout == "per-block" ? run_blocks(tokens, chosen, {1.0f}) : run_path(*modules[0], expert, tokens, 1.0f);
  }

  ExpertCache& cache() { return cache_; }

 private:
  const Bundle& bundle_;
  Loader& loader_;
  std::unique_ptr<Module> first_;  // the router, or the one dense / monolithic graph
  std::vector<std::unique_ptr<Module>> shared_;  // per-block: each MoE block's attention half
  std::unique_ptr<Module> head_;                  // per-block: final norm + classifier
  ExpertCache cache_;

  std::vector<float> run_path(Module& module, int expert, std::vector<float>& tokens, float gate) {
    const Graph& graph = bundle_.experts[expert][0];
    return run(module, {{tokens.data(), graph.input_shapes.at(0)}, {&gate, graph.input_shapes.at(1)}}).at(0);
  }

  // x = tokens; per block: residual, normed = shared(x); x = residual + sum_j gate_j * expert_j(normed); head(x).
  std::vector<float> run_blocks(std::vector<float> x, std::vector<std::vector<std::unique_ptr<Module>>*>& chosen,
                                const std::vector<float>& gates) {
    for (size_t block = 0; block < shared_.size(); ++block) {
      auto halves = run(*shared_[block], {{x.data(), bundle_.shared[block].input_shapes.at(0)}});
      x = halves.at(0);  // residual
      std::vector<float>& normed = halves.at(1);
      for (size_t j = 0; j < chosen.size(); ++j) {
        auto delta = run(*chosen[j]->at(block), {{normed.data(), bundle_.shared[block].input_shapes.at(0)}}).at(0);
        for (size_t i = 0; i < x.size(); ++i) x[i] += gates[j] * delta[i];
      }
    }
    return run(*head_, {{x.data(), bundle_.head.input_shapes.at(0)}}).at(0);
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Inputs, statistics, memory

std::vector<std::vector<float>> read_images(const Options& options, const Bundle& bundle) {
  size_t per_image = 1;
  for (size_t i = 1; i < bundle.image_shape.size(); ++i) per_image *= static_cast<size_t>(bundle.image_shape[i]);
  std::vector<std::vector<float>> images;
  if (!options.input_path.empty()) {
    std::string raw = read_file(options.input_path);
    if (raw.empty() || raw.size() % (per_image * sizeof(float)) != 0)
      throw UsageError(options.input_path + " holds " + std::to_string(raw.size()) +
                       " bytes, not a whole number of float32 images of " + std::to_string(per_image) + " values");
    for (size_t offset = 0; offset < raw.size(); offset += per_image * sizeof(float)) {
      images.emplace_back(per_image);
      std::memcpy(images.back().data(), raw.data() + offset, per_image * sizeof(float));
    }
    return images;
  }
  std::mt19937 generator(options.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int n = 0; n < options.random_images; ++n) {
    images.emplace_back(per_image);
    for (auto& value : images.back()) value = normal(generator);
  }
  return images;
}

// Percentiles with linear interpolation between order statistics (numpy's default), so both sides agree.
double percentile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  double position = q / 100.0 * static_cast<double>(values.size() - 1);
  size_t below = static_cast<size_t>(position);
  size_t above = std::min(below + 1, values.size() - 1);
  return values[below] + (position - static_cast<double>(below)) * (values[above] - values[below]);
}

double median(const std::vector<double>& values) { return values.empty() ? -1.0 : percentile(values, 50); }

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

void set_threads(int threads) {
  auto* pool = executorch::extension::threadpool::get_threadpool();
  if (pool != nullptr) pool->_unsafe_reset_threadpool(static_cast<uint32_t>(threads));
}

void enable_weight_cache() {
  executorch::runtime::BackendOptions<1> options;
  options.set_option("weight_cache_enabled", true);
  auto status = executorch::runtime::set_option("XnnpackBackend", options.view());
  if (status != executorch::runtime::Error::Ok)
    throw std::runtime_error("this ExecuTorch build does not accept XNNPACK's weight_cache_enabled option");
}

// ---------------------------------------------------------------------------------------------------------------

std::string measure(const Options& options) {
  Bundle bundle = read_bundle(options.bundle);
  auto images = read_images(options, bundle);
  int num_experts = bundle.kind == "split" ? bundle.num_experts : 0;
  int cache_experts = options.cache_experts < 0 ? std::max(num_experts, 1) : options.cache_experts;
  if (bundle.kind == "split" && cache_experts < 1) throw UsageError("--cache-experts must be at least 1");
  set_threads(options.threads);
  if (options.weight_cache) enable_weight_cache();
  auto* pool = executorch::extension::threadpool::get_threadpool();

  json::Writer out;
  out.begin_object();
  out.key("runner").value("mobile-moe-native");
  out.key("bundle").value(bundle.dir);
  out.key("kind").value(bundle.kind);
  out.key("layout").value(bundle.layout);
  out.key("threads").value(pool != nullptr ? static_cast<int64_t>(pool->get_thread_count()) : int64_t{1});
  out.key("load_mode").value(options.load_mode);
  out.key("weight_cache").value(options.weight_cache);
  out.key("num_experts").value(num_experts);
  out.key("top_k").value(bundle.top_k);
  out.key("cache_experts").value(cache_experts);
  out.key("num_images").value(images.size());
  out.key("iterations").value(options.iterations);
  out.key("warmup").value(options.warmup);
  out.key("memory_at_start");
  write_memory(out, stats::memory_now());

  // 1. cold load of the router (or the single graph)
  Loader loader(options.load_mode);
  Pipeline pipeline(bundle, loader, cache_experts);
  double first_load_ms = pipeline.load_resident();
  out.key("load_ms").begin_object();
  out.key(bundle.kind == "split" ? "router" : bundle.kind).value(first_load_ms);
  out.end_object();
  out.key("memory_after_first_load");
  write_memory(out, stats::memory_now());

  // 2. routing pass: each image once, in order, through the expert cache
  std::set<std::string> files_seen;
  auto note_open_files = [&]() {
    for (const auto& file : stats::open_files_under(bundle.dir)) files_seen.insert(file);
  };
  note_open_files();
  std::map<int, double> cold_expert_load_ms;  // the first load of each expert in this process
  int64_t bytes_before_routing = loader.bytes_loaded;
  out.key("images").begin_array();
  for (auto& image : images) {
    Inference result = pipeline.infer(image.data());
    note_open_files();
    if (!result.hit && !cold_expert_load_ms.count(result.experts[0])) cold_expert_load_ms[result.experts[0]] = result.load_ms;
    out.begin_object();
    out.key("experts").array(result.experts);
    out.key("gates").array(std::vector<double>(result.gates.begin(), result.gates.end()));
    out.key("logits").array(std::vector<double>(result.logits.begin(), result.logits.end()));
    out.key("router_ms").value(result.router_ms);
    out.key("expert_ms").value(result.expert_ms);
    out.key("load_ms").value(result.load_ms);
    out.key("total_ms").value(result.total_ms);
    out.key("cache_hit").value(result.hit);
    out.end_object();
  }
  out.end_array();
  int64_t routing_bytes = loader.bytes_loaded - bytes_before_routing;
  out.key("routing_pass_graph_bytes_loaded").value(routing_bytes);
  out.key("graphs_loaded_after_routing").array(pipeline.cache().loaded_names());
  out.key("files_open_after_routing").array(stats::open_files_under(bundle.dir));
  out.key("memory_after_routing");
  write_memory(out, stats::memory_now());

  // 3. warm-up, then timed end-to-end iterations cycling over the images
  for (int i = 0; i < options.warmup; ++i) pipeline.infer(images[i % images.size()].data());
  std::vector<double> total, router, expert, loads;
  for (int i = 0; i < options.iterations; ++i) {
    Inference result = pipeline.infer(images[i % images.size()].data());
    total.push_back(result.total_ms);
    router.push_back(result.router_ms);
    expert.push_back(result.expert_ms);
    if (!result.hit) loads.push_back(result.load_ms);
  }
  note_open_files();
  out.key("latency_ms");
  write_summary(out, total);
  out.key("stages_ms").begin_object();
  out.key(bundle.kind == "split" ? "router" : bundle.kind);
  write_summary(out, router);
  if (bundle.kind == "split") {
    out.key("expert");
    write_summary(out, expert);
  }
  out.end_object();
  out.key("timed_expert_loads").value(loads.size());
  out.key("memory_after_warm");
  write_memory(out, stats::memory_now());

  // What the routing pass and the timed runs had open: by design only the router and the experts the images chose.
  out.key("files_opened").array(std::vector<std::string>(files_seen.begin(), files_seen.end()));

  // 4. switch cost: an expert that is not loaded, loaded and run once (what a phone pays when routing changes)
  std::vector<double> switch_ms, switch_load_ms, switch_first_run_ms, switch_warm_run_ms;
  if (bundle.kind == "split") {
    std::vector<float> tokens = pipeline.route(images[0].data()).at(0);  // real tokens, so the expert sees real input
    for (int repeat = 0; repeat < options.switch_repeats; ++repeat) {
      for (int e = 0; e < num_experts; ++e) {
        pipeline.cache().unload(e);
        auto start = Clock::now();
        bool hit = false;
        double load_ms = 0;
        auto& modules = pipeline.cache().get(e, &hit, &load_ms);
        if (!cold_expert_load_ms.count(e)) cold_expert_load_ms[e] = load_ms;
        auto run_start = Clock::now();
        pipeline.run_expert(e, modules, tokens);
        switch_first_run_ms.push_back(ms_since(run_start));
        switch_ms.push_back(ms_since(start));
        switch_load_ms.push_back(load_ms);
        auto warm_start = Clock::now();
        pipeline.run_expert(e, modules, tokens);
        switch_warm_run_ms.push_back(ms_since(warm_start));
        note_open_files();
      }
    }
  }
  out.key("expert_load_ms").begin_object();
  for (const auto& [e, ms] : cold_expert_load_ms) out.key(std::to_string(e)).value(ms);
  out.end_object();
  out.key("switch").begin_object();
  out.key("ms").array(switch_ms);
  out.key("median_ms").value(median(switch_ms));
  out.key("load_median_ms").value(median(switch_load_ms));
  out.key("first_run_median_ms").value(median(switch_first_run_ms));
  out.key("warm_expert_run_median_ms").value(median(switch_warm_run_ms));
  out.end_object();

  // Graph bytes each image needs: the router (or single graph) plus its chosen experts' files.
  out.key("graph_bytes").begin_object();
  out.key(bundle.first().name).value(bundle.first().bytes);
  for (const auto& graph : bundle.shared) out.key(graph.name).value(graph.bytes);
  if (bundle.layout == "per-block") out.key(bundle.head.name).value(bundle.head.bytes);
  for (const auto& graphs : bundle.experts)
    for (const auto& graph : graphs) out.key(graph.name).value(graph.bytes);
  out.end_object();
  out.key("graph_bytes_loaded_total").value(loader.bytes_loaded);
  out.key("loads").begin_array();
  for (const auto& event : loader.events) {
    out.begin_object();
    out.key("graph").value(event.graph);
    out.key("bytes").value(event.bytes);
    out.key("ms").value(event.ms);
    out.key("program_ms").value(event.program_ms);
    out.key("method_ms").value(event.method_ms);
    out.end_object();
  }
  out.end_array();
  out.key("files_opened_incl_switch").array(std::vector<std::string>(files_seen.begin(), files_seen.end()));
  out.key("memory_at_end");
  write_memory(out, stats::memory_now());
  out.end_object();
  return out.str();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Options options = parse_options(argc, argv);
    std::string report = measure(options);
    std::fwrite(report.data(), 1, report.size(), stdout);
    std::fputc('\n', stdout);
    return 0;
  } catch (const UsageError& error) {
    std::fprintf(stderr, "mobile_moe_runner: %s\n", error.what());
    return 2;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "mobile_moe_runner: error: %s\n", error.what());
    return 1;
  }
}
