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
#include <executorch/runtime/core/error.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/platform.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
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
#include "sha256.h"

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

// One line: every error the runner prints is one line on stderr.
const char* kUsage =
    "usage: mobile_moe_runner --bundle DIR [--input FILE.f32 | --random N] [--iterations N] [--warmup N] "
    "[--threads T] [--cache-experts C] [--switch-repeats R] [--seed S] [--weight-cache] [--load-mode mmap|file]; "
    "or mobile_moe_runner --sha256 FILE...";

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
    else if (flag == "--threads") options.threads = to_int(flag, next(), 1, 1024);
    else if (flag == "--cache-experts") options.cache_experts = to_int(flag, next(), 1, 1 << 20);
    else if (flag == "--switch-repeats") options.switch_repeats = to_int(flag, next(), 0, kMaxFlag);
    else if (flag == "--seed") options.seed = static_cast<unsigned>(to_int(flag, next(), 0, INT_MAX));
    else if (flag == "--weight-cache") options.weight_cache = true;
    else if (flag == "--load-mode") options.load_mode = next();
    else if (flag == "--help" || flag == "-h") throw UsageError(kUsage);
    else throw UsageError("unknown flag " + flag + " (" + kUsage + ")");
  }
  if (options.bundle.empty()) throw UsageError(std::string("--bundle is required (") + kUsage + ")");
  if (options.load_mode != "mmap" && options.load_mode != "file") throw UsageError("--load-mode is mmap or file");
  return options;
}

// ---------------------------------------------------------------------------------------------------------------
// Bundle (manifest.json)
//
// The manifest is untrusted input (a bundle can be copied to a phone by hand, where no Python validated it), so the
// runner enforces the rules of the one manifest schema (export/manifest_schema.py) itself: every value it uses is
// type- and range-checked (integers exact: 1.5, 1e300, -3, true and "4" are refused), the layout's cross-field rules
// hold, every graph file matches its size and sha256 before any graph is loaded, and each loaded program's method
// signature matches the graph's specs before it runs. Every violation is a UsageError (exit 2), never a crash.

// Bounds shared with export/manifest_schema.py.
constexpr int64_t kMaxExperts = 4096;
constexpr int64_t kMaxDim = int64_t{1} << 16;
constexpr int64_t kMaxElements = int64_t{1} << 28;
constexpr int64_t kMaxClasses = int64_t{1} << 20;
constexpr int64_t kMaxCount = int64_t{1} << 62;
constexpr int64_t kMaxGraphs = int64_t{1} << 16;
const char* const kRoles[] = {"router", "expert", "block_shared", "block_expert", "head", "monolithic", "dense"};
const char* const kLayouts[] = {"dense", "monolithic", "expert-paths", "per-block"};
const char* const kBackends[] = {"executorch", "onnx", "coreml"};

struct Spec {
  std::string name;
  std::vector<int32_t> shape;
  int64_t numel = 1;
};

struct Graph {
  std::string name, role, file, path, sha256;
  int expert = -1;
  int64_t bytes = 0;  // the manifest's size, checked against the file
  std::vector<Spec> inputs, outputs;
  std::vector<std::vector<int32_t>> input_shapes;
  // Index of the named output ("logits", "tokens", "router_probs") among the outputs; -1 when absent.
  int output(const std::string& name) const {
    for (size_t i = 0; i < outputs.size(); ++i)
      if (outputs[i].name == name) return static_cast<int>(i);
    return -1;
  }
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
  std::vector<Graph> all;                    // every graph the manifest lists (all are checksummed)
  const Graph& first() const { return kind == "split" ? router : single; }
  int64_t expert_bytes(int e) const {
    int64_t total = 0;
    for (const auto& graph : experts[e]) total += graph.bytes;
    return total;
  }
};

std::string real_path(const std::string& path) {
  char resolved[PATH_MAX];
  if (realpath(path.c_str(), resolved) == nullptr) return "";
  return resolved;
}

// A regular file no larger than max_bytes, read whole; UsageError naming `what` otherwise.
std::string read_file(const std::string& path, const std::string& what, uint64_t max_bytes) {
  struct stat info {};
  if (stat(path.c_str(), &info) != 0) throw UsageError("cannot read " + what + " " + path + ": " + std::strerror(errno));
  if (!S_ISREG(info.st_mode)) throw UsageError(what + " " + path + " is not a regular file");
  if (static_cast<uint64_t>(info.st_size) > max_bytes)
    throw UsageError(what + " " + path + " is larger than " + std::to_string(max_bytes) + " bytes");
  std::ifstream file(path, std::ios::binary);
  if (!file) throw UsageError("cannot read " + what + " " + path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// A manifest rule broken at `where` (a dotted path like graphs.0.inputs.1.shape); read_bundle adds the file name.
struct Invalid : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void invalid(const std::string& where, const std::string& what) {
  throw Invalid((where.empty() ? std::string("manifest") : where) + ": " + what);
}
std::string child(const std::string& where, const std::string& key) { return where.empty() ? key : where + "." + key; }
std::string child(const std::string& where, size_t index) { return child(where, std::to_string(index)); }

std::string shown(const json::Value& value) {
  if (value.is_number()) {
    char text[64];
    std::snprintf(text, sizeof(text), "%.17g", value.number);
    return value.integer_text && !value.integral ? "an integer beyond 64 bits" : text;
  }
  if (value.is_string()) return "\"" + (value.string.size() > 40 ? value.string.substr(0, 40) + "..." : value.string) + "\"";
  return json::describe(value);
}

const json::Value& object_at(const json::Value& object, const std::string& where, const std::string& key) {
  if (!object.is_object()) invalid(where, "must be an object, not " + json::describe(object));
  if (!object.has(key)) invalid(child(where, key), "is missing");
  return object.at(key);
}
// Absent or null -> nullptr.
const json::Value* optional_at(const json::Value& object, const std::string& where, const std::string& key) {
  if (!object.is_object()) invalid(where, "must be an object, not " + json::describe(object));
  if (!object.has(key) || object.at(key).is_null()) return nullptr;
  return &object.at(key);
}

int64_t as_int(const json::Value& value, const std::string& where, int64_t low, int64_t high) {
  if (!value.is_number() || !value.integer_text)
    invalid(where, "must be an integer, not " + shown(value));
  if (!value.integral || value.whole < low || value.whole > high)
    invalid(where, shown(value) + " is out of range (" + std::to_string(low) + ".." + std::to_string(high) + ")");
  return value.whole;
}

size_t utf8_length(const std::string& text) {
  size_t count = 0;
  for (char c : text) count += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
  return count;
}

const std::string& as_str(const json::Value& value, const std::string& where, size_t min_chars, size_t max_chars) {
  if (!value.is_string()) invalid(where, "must be a string, not " + shown(value));
  size_t length = utf8_length(value.string);
  if (length < min_chars || length > max_chars)
    invalid(where, "must be " + std::to_string(min_chars) + " to " + std::to_string(max_chars) + " characters long");
  return value.string;
}

double as_finite(const json::Value& value, const std::string& where) {
  if (!value.is_number()) invalid(where, "must be a number, not " + shown(value));
  if (!std::isfinite(value.number)) invalid(where, "must be finite");
  return value.number;
}

bool as_bool(const json::Value& value, const std::string& where) {
  if (!value.is_bool()) invalid(where, "must be true or false, not " + shown(value));
  return value.boolean;
}

const std::vector<json::Value>& as_array(const json::Value& value, const std::string& where, size_t min_items,
                                         size_t max_items) {
  if (!value.is_array()) invalid(where, "must be a list, not " + shown(value));
  if (value.array.size() < min_items || value.array.size() > max_items)
    invalid(where, "must hold " + std::to_string(min_items) + " to " + std::to_string(max_items) + " items, not " +
                       std::to_string(value.array.size()));
  return value.array;
}

template <size_t N>
const std::string& one_of(const json::Value& value, const std::string& where, const char* const (&choices)[N]) {
  const std::string& text = as_str(value, where, 0, 256);
  for (const char* choice : choices)
    if (text == choice) return text;
  std::string listed;
  for (const char* choice : choices) listed += (listed.empty() ? "" : ", ") + std::string(choice);
  invalid(where, shown(value) + " is not one of " + listed);
}

std::string shape_text(const std::vector<int32_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// A shape: 1..8 dimensions of 1..2^16, at most 2^28 elements (the product cannot overflow: checked as it grows).
std::vector<int32_t> shape_of(const json::Value& value, const std::string& where, size_t min_dims, size_t max_dims,
                              int64_t* numel) {
  std::vector<int32_t> shape;
  int64_t product = 1;
  const auto& dims = as_array(value, where, min_dims, max_dims);
  for (size_t i = 0; i < dims.size(); ++i) {
    shape.push_back(static_cast<int32_t>(as_int(dims[i], child(where, i), 1, kMaxDim)));
    product *= shape.back();
    if (product > kMaxElements) invalid(where, "has more than " + std::to_string(kMaxElements) + " elements");
  }
  if (numel != nullptr) *numel = product;
  return shape;
}

Spec spec_of(const json::Value& value, const std::string& where) {
  Spec spec;
  spec.name = as_str(object_at(value, where, "name"), child(where, "name"), 1, 256);
  spec.shape = shape_of(object_at(value, where, "shape"), child(where, "shape"), 1, 8, &spec.numel);
  if (as_str(object_at(value, where, "dtype"), child(where, "dtype"), 0, 256) != "float32")
    invalid(child(where, "dtype"), "must be \"float32\"");
  return spec;
}

bool is_hex_digest(const std::string& text) {
  if (text.size() != 64) return false;
  for (char c : text)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

Graph graph_from(const json::Value& entry, const std::string& where, const std::string& dir) {
  Graph graph;
  graph.name = as_str(object_at(entry, where, "name"), child(where, "name"), 1, 256);
  graph.role = one_of(object_at(entry, where, "role"), child(where, "role"), kRoles);
  const json::Value& expert = object_at(entry, where, "expert");  // required, may be null
  graph.expert = expert.is_null() ? -1 : static_cast<int>(as_int(expert, child(where, "expert"), 0, kMaxExperts - 1));
  if (const json::Value* block = optional_at(entry, where, "block")) as_int(*block, child(where, "block"), 0, 4096);
  graph.file = as_str(object_at(entry, where, "file"), child(where, "file"), 1, 4096);
  graph.sha256 = as_str(object_at(entry, where, "sha256"), child(where, "sha256"), 0, 64);
  if (!is_hex_digest(graph.sha256)) invalid(child(where, "sha256"), "must be 64 lowercase hex digits");
  graph.bytes = as_int(object_at(entry, where, "bytes"), child(where, "bytes"), 0, kMaxCount);
  as_int(object_at(entry, where, "params"), child(where, "params"), 0, kMaxCount);
  const auto& inputs = as_array(object_at(entry, where, "inputs"), child(where, "inputs"), 1, 16);
  for (size_t i = 0; i < inputs.size(); ++i) graph.inputs.push_back(spec_of(inputs[i], child(child(where, "inputs"), i)));
  const auto& outputs = as_array(object_at(entry, where, "outputs"), child(where, "outputs"), 1, 16);
  for (size_t i = 0; i < outputs.size(); ++i)
    graph.outputs.push_back(spec_of(outputs[i], child(child(where, "outputs"), i)));
  for (const auto& spec : graph.inputs) graph.input_shapes.push_back(spec.shape);

  // The file: relative, inside the bundle (a bundle is untrusted input on a phone), a regular file.
  if (graph.file[0] == '/')
    throw UsageError("graph " + graph.name + ": file " + graph.file + " must be a path relative to the bundle");
  graph.path = real_path(dir + "/" + graph.file);
  if (graph.path.empty())
    throw UsageError("graph " + graph.name + ": file " + graph.file + " named in the manifest is missing; re-export the bundle");
  if (graph.path.compare(0, dir.size() + 1, dir + "/") != 0)
    throw UsageError("graph " + graph.name + ": file " + graph.file + " leaves the bundle directory; refusing it");
  struct stat info {};
  if (stat(graph.path.c_str(), &info) != 0 || !S_ISREG(info.st_mode))
    throw UsageError("graph " + graph.name + ": file " + graph.file + " is not a regular file");
  return graph;
}

void expect_shape(const Graph& graph, const Spec* spec, const std::vector<int32_t>& expected, const std::string& what) {
  if (spec == nullptr) invalid("graph " + graph.name, "has no " + what + "; it must have shape " + shape_text(expected));
  if (spec->shape != expected)
    invalid("graph " + graph.name, what + " shape " + shape_text(spec->shape) + " must be " + shape_text(expected));
}
const Spec* output_spec(const Graph& graph, const std::string& name) {
  int index = graph.output(name);
  return index < 0 ? nullptr : &graph.outputs[index];
}
void expect_inputs(const Graph& graph, const std::vector<std::vector<int32_t>>& expected) {
  if (graph.input_shapes != expected) {
    std::string want;
    for (const auto& shape : expected) want += (want.empty() ? "" : ", ") + shape_text(shape);
    invalid("graph " + graph.name, "inputs must have shapes " + want);
  }
}

// Everything the schema checks (types, ranges, layout rules), then the runner's own needs.
void validate(const json::Value& manifest, Bundle& bundle) {
  if (!manifest.is_object()) invalid("manifest", "must be a JSON object, not " + json::describe(manifest));
  const json::Value& format = object_at(manifest, "", "format");
  if (!format.is_string() || format.string != "mobile-moe-bundle") invalid("format", "must be \"mobile-moe-bundle\"");
  if (as_int(object_at(manifest, "", "version"), "version", INT64_MIN, INT64_MAX) != 1)
    invalid("version", "this runner reads version 1 manifests only");
  const std::string& backend = one_of(object_at(manifest, "", "backend"), "backend", kBackends);
  if (backend != "executorch")
    throw UsageError("the native runner runs ExecuTorch bundles; this is a " + backend + " bundle");

  const json::Value& model = object_at(manifest, "", "model");
  as_str(object_at(model, "model", "name"), "model.name", 1, 256);
  int64_t image_size = as_int(object_at(model, "model", "image_size"), "model.image_size", 1, kMaxDim);
  int64_t in_chans = as_int(object_at(model, "model", "in_chans"), "model.in_chans", 1, 4);
  int64_t num_classes = as_int(object_at(model, "model", "num_classes"), "model.num_classes", 1, kMaxClasses);
  if (const json::Value* renormalize = optional_at(model, "model", "renormalize_gates"))
    bundle.renormalize_gates = as_bool(*renormalize, "model.renormalize_gates");
  else if (model.has("renormalize_gates"))
    invalid("model.renormalize_gates", "must be true or false, not null");

  bundle.num_experts = static_cast<int>(as_int(object_at(manifest, "", "num_experts"), "num_experts", 0, kMaxExperts));
  bundle.top_k = static_cast<int>(as_int(object_at(manifest, "", "top_k"), "top_k", 0, kMaxExperts));

  const json::Value& input = object_at(manifest, "", "input");
  int64_t image_numel = 0;
  bundle.image_shape = shape_of(object_at(input, "input", "shape"), "input.shape", 4, 4, &image_numel);
  if (as_str(object_at(input, "input", "dtype"), "input.dtype", 0, 256) != "float32")
    invalid("input.dtype", "must be \"float32\"");
  const auto& mean = as_array(object_at(input, "input", "mean"), "input.mean", 0, 4096);
  const auto& std_dev = as_array(object_at(input, "input", "std"), "input.std", 0, 4096);
  for (size_t i = 0; i < mean.size(); ++i) as_finite(mean[i], child("input.mean", i));
  for (size_t i = 0; i < std_dev.size(); ++i)
    if (as_finite(std_dev[i], child("input.std", i)) <= 0) invalid(child("input.std", i), "must be greater than 0");
  const auto& shape = bundle.image_shape;
  if (shape[0] != 1 || shape[1] > 4 || shape[2] != shape[3])
    invalid("input.shape", shape_text(shape) + " must be (1, C, S, S) with C <= 4");
  if (mean.size() != static_cast<size_t>(shape[1]) || std_dev.size() != static_cast<size_t>(shape[1]))
    invalid("input", "mean and std need " + std::to_string(shape[1]) + " values (one per channel)");
  std::vector<int32_t> model_shape{1, static_cast<int32_t>(in_chans), static_cast<int32_t>(image_size),
                                   static_cast<int32_t>(image_size)};
  if (shape != model_shape)
    invalid("input.shape", shape_text(shape) + " differs from the model's " + shape_text(model_shape));

  const auto& class_names = as_array(object_at(manifest, "", "class_names"), "class_names", 0, kMaxClasses);
  for (size_t i = 0; i < class_names.size(); ++i) as_str(class_names[i], child("class_names", i), 0, 1024);
  if (static_cast<int64_t>(class_names.size()) != num_classes)
    invalid("class_names", std::to_string(class_names.size()) + " names for a model with " +
                               std::to_string(num_classes) + " classes");
  if (const json::Value* names = optional_at(manifest, "", "super_class_names")) {
    const auto& items = as_array(*names, "super_class_names", 0, kMaxClasses);
    for (size_t i = 0; i < items.size(); ++i) as_str(items[i], child("super_class_names", i), 0, 1024);
  }

  // Graphs: unique names, each entry well-formed and its file inside the bundle.
  std::map<std::string, Graph> graphs;
  const auto& entries = as_array(object_at(manifest, "", "graphs"), "graphs", 1, kMaxGraphs);
  for (size_t i = 0; i < entries.size(); ++i) {
    Graph graph = graph_from(entries[i], child("graphs", i), bundle.dir);
    if (graphs.count(graph.name)) invalid("graphs", "two graphs are named \"" + graph.name + "\"");
    graphs[graph.name] = graph;
    bundle.all.push_back(graph);
  }

  // The composition and the layout's rules (export/manifest_schema.py: _check_single, _check_expert_paths, ...).
  const json::Value& composition = object_at(manifest, "", "composition");
  bundle.layout = one_of(object_at(composition, "composition", "layout"), "composition.layout", kLayouts);
  auto name_at = [&](const json::Value& value, const std::string& where) -> std::string {
    return as_str(value, where, 1, 256);
  };
  auto named = [&](const json::Value* value, const std::string& role, const std::string& what) -> const Graph& {
    std::string where = "composition." + what;
    if (value == nullptr) invalid(where, "names no graph");
    std::string name = name_at(*value, where);
    auto found = graphs.find(name);
    if (found == graphs.end()) invalid(where, "names graph \"" + name + "\", which is not in graphs");
    if (found->second.role != role)
      invalid(where, "graph \"" + name + "\" has role " + found->second.role + ", expected " + role);
    return found->second;
  };
  const std::vector<int32_t> logits_shape{1, static_cast<int32_t>(num_classes)};
  auto check_experts_and_k = [&](int k_max) {
    if (bundle.num_experts < 1) invalid("num_experts", "a Mobile V-MoE bundle needs at least 1 expert");
    if (const json::Value* model_experts = optional_at(model, "model", "num_experts"))
      if (!model_experts->is_number() || !model_experts->integral || model_experts->whole != bundle.num_experts)
        invalid("num_experts", std::to_string(bundle.num_experts) + " differs from the model's " + shown(*model_experts));
    if (bundle.top_k < 1 || bundle.top_k > k_max)
      invalid("top_k", std::to_string(bundle.top_k) + " must be between 1 and " + std::to_string(k_max) + " for the " +
                           bundle.layout + " layout");
  };
  const std::vector<int32_t> probs_shape{1, static_cast<int32_t>(bundle.num_experts)};
  auto check_router = [&]() -> std::vector<int32_t> {
    bundle.router = named(optional_at(composition, "composition", "router"), "router", "router");
    const Graph& router = bundle.router;
    if (router.inputs.size() != 1) invalid("graph " + router.name, "needs exactly one input (images)");
    expect_shape(router, &router.inputs[0], shape, "input");
    expect_shape(router, output_spec(router, "router_probs"), probs_shape, "router_probs");
    const Spec* tokens = output_spec(router, "tokens");
    if (tokens == nullptr || tokens->shape.size() != 3 || tokens->shape[0] != 1)
      invalid("graph " + router.name, "needs a tokens output of shape (1, T, D)");
    return tokens->shape;
  };

  if (bundle.layout == "dense" || bundle.layout == "monolithic") {
    if (graphs.size() != 1 || entries.size() != 1 || bundle.all[0].role != bundle.layout)
      invalid("graphs", "a " + bundle.layout + " bundle holds exactly one graph with role " + bundle.layout);
    bundle.single = bundle.all[0];
    bundle.kind = bundle.layout;
    if (bundle.single.inputs.size() != 1) invalid("graph " + bundle.single.name, "needs exactly one input (images)");
    expect_shape(bundle.single, &bundle.single.inputs[0], shape, "input");
    expect_shape(bundle.single, output_spec(bundle.single, "logits"), logits_shape, "logits");
    if (bundle.layout == "dense") {
      if (bundle.num_experts != 0 || bundle.top_k != 0) invalid("num_experts", "a dense bundle has num_experts 0 and top_k 0");
    } else {
      check_experts_and_k(bundle.num_experts);
      expect_shape(bundle.single, output_spec(bundle.single, "router_probs"), probs_shape, "router_probs");
    }
    return;
  }

  bundle.kind = "split";
  bundle.experts.assign(bundle.num_experts, {});
  if (bundle.layout == "expert-paths") {
    check_experts_and_k(1);
    std::vector<int32_t> tokens = check_router();
    const json::Value* names = optional_at(composition, "composition", "experts");
    const auto& listed = names == nullptr ? std::vector<json::Value>{} : as_array(*names, "composition.experts", 0, kMaxExperts);
    if (static_cast<int64_t>(listed.size()) != bundle.num_experts)
      invalid("composition.experts", "names " + std::to_string(listed.size()) + " graphs for " +
                                         std::to_string(bundle.num_experts) + " experts");
    for (int e = 0; e < bundle.num_experts; ++e) {
      const Graph& expert = named(&listed[e], "expert", "experts." + std::to_string(e));
      if (expert.expert != e)
        invalid("graph " + expert.name, "is listed as expert " + std::to_string(e) + " but says expert " +
                                            std::to_string(expert.expert));
      expect_inputs(expert, {tokens, {1, 1}});
      expect_shape(expert, output_spec(expert, "logits"), logits_shape, "logits");
      bundle.experts[e] = {expert};
    }
    return;
  }

  // per-block
  check_experts_and_k(bundle.num_experts);
  std::vector<int32_t> tokens = check_router();
  const json::Value* blocks = optional_at(composition, "composition", "blocks");
  if (blocks == nullptr || as_array(*blocks, "composition.blocks", 0, 4097).empty())
    invalid("composition.blocks", "a per-block bundle needs composition.blocks");
  for (size_t b = 0; b < blocks->array.size(); ++b) {
    const json::Value& block = blocks->array[b];
    std::string where = child("composition.blocks", b);
    const Graph& shared = named(&object_at(block, where, "shared"), "block_shared", "blocks." + std::to_string(b) + ".shared");
    expect_inputs(shared, {tokens});
    if (shared.outputs.size() != 2 || shared.outputs[0].shape != tokens || shared.outputs[1].shape != tokens)
      invalid("graph " + shared.name, "outputs must be (residual, normed), both of shape " + shape_text(tokens));
    bundle.shared.push_back(shared);
    const auto& listed = as_array(object_at(block, where, "experts"), child(where, "experts"), 0, kMaxExperts);
    if (static_cast<int64_t>(listed.size()) != bundle.num_experts)
      invalid(child(where, "experts"), "names " + std::to_string(listed.size()) + " experts, not " +
                                           std::to_string(bundle.num_experts));
    for (int e = 0; e < bundle.num_experts; ++e) {
      const Graph& expert =
          named(&listed[e], "block_expert", "blocks." + std::to_string(b) + ".experts." + std::to_string(e));
      if (expert.expert != e)
        invalid("graph " + expert.name, "is listed as expert " + std::to_string(e) + " but says expert " +
                                            std::to_string(expert.expert));
      expect_inputs(expert, {tokens});
      if (expert.outputs.size() != 1 || expert.outputs[0].shape != tokens)
        invalid("graph " + expert.name, "needs one output of shape " + shape_text(tokens));
      bundle.experts[e].push_back(expert);
    }
  }
  bundle.head = named(optional_at(composition, "composition", "head"), "head", "head");
  expect_inputs(bundle.head, {tokens});
  expect_shape(bundle.head, output_spec(bundle.head, "logits"), logits_shape, "logits");
}

// Every graph file the manifest lists must have the recorded size and sha256: checked before any graph is loaded.
void verify_graph_files(const Bundle& bundle) {
  for (const auto& graph : bundle.all) {
    std::string digest;
    uint64_t size = 0;
    if (!mobile_moe::sha256::file_digest(graph.path, &digest, &size))
      throw UsageError("graph " + graph.name + ": cannot read " + graph.file);
    if (static_cast<int64_t>(size) != graph.bytes || digest != graph.sha256)
      throw UsageError("graph " + graph.name + ": " + graph.file +
                       " does not match the sha256 in the manifest (tampered with or truncated); re-export the bundle");
  }
}

Bundle read_bundle(const std::string& path) {
  Bundle bundle;
  bundle.dir = real_path(path);
  if (bundle.dir.empty()) throw UsageError("bundle directory " + path + " does not exist");
  std::string manifest_path = bundle.dir + "/manifest.json";
  struct stat info {};
  if (stat(manifest_path.c_str(), &info) != 0)
    throw UsageError(path + " has no manifest.json: export a bundle with `mobile-moe export`");
  std::string origin = path + "/manifest.json";
  json::Value manifest;
  try {
    manifest = json::parse(read_file(manifest_path, "manifest", json::kMaxBytes));
  } catch (const json::Error& error) {
    throw UsageError(origin + " is not valid JSON: " + error.what());
  }
  try {
    validate(manifest, bundle);
  } catch (const Invalid& error) {
    throw UsageError(origin + ": " + error.what());
  }
  verify_graph_files(bundle);
  return bundle;
}

// ---------------------------------------------------------------------------------------------------------------
// ExecuTorch's log: kept off stderr (the runner's stderr is one line on failure), its last error quoted in ours.
// MOBILE_MOE_DEBUG=1 passes every log line through.

std::string g_last_runtime_error;
bool g_debug = false;

void capture_log(et_timestamp_t, et_pal_log_level_t level, const char* filename, const char*, size_t line,
                 const char* message, size_t length) {
  std::string text(message, length);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  if (g_debug) std::fprintf(stderr, "%c executorch:%s:%zu] %s\n", static_cast<char>(level), filename, line, text.c_str());
  if (level == kError || level == kFatal) g_last_runtime_error = text.substr(0, 200);
}

// "(ExecuTorch error 35 InvalidProgram: Verification failed; ...)": the status, and what the runtime logged about it.
std::string runtime_error_text(executorch::runtime::Error status) {
  std::string text = "ExecuTorch error " + std::to_string(static_cast<int>(status)) + " " +
                     executorch::runtime::to_string(status);
  if (!g_last_runtime_error.empty()) text += ": " + g_last_runtime_error;
  g_last_runtime_error.clear();
  return "(" + text + ")";
}

// What the runner is doing, for the one line a fatal signal prints (written before the work, read in the handler).
char g_phase[256] = "starting";
void set_phase(const std::string& phase) {
  std::snprintf(g_phase, sizeof(g_phase), "%s", phase.c_str());
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

// The program's forward signature must be the graph's specs from the manifest: as many inputs and outputs, each a
// float32 tensor of the listed shape. Checked before the method is initialised, so nothing runs on a mismatch.
void check_signature(Module& module, const Graph& graph) {
  using executorch::runtime::Tag;
  auto meta = module.method_meta("forward");
  if (!meta.ok())
    throw UsageError("graph " + graph.name + ": " + graph.file + " has no forward method " +
                     runtime_error_text(meta.error()));
  auto compare = [&](const char* what, size_t count, const std::vector<Spec>& specs, auto tag_of, auto info_of) {
    if (count != specs.size())
      throw UsageError("graph " + graph.name + ": " + graph.file + " takes " + std::to_string(count) + " " + what +
                       " but the manifest lists " + std::to_string(specs.size()));
    for (size_t i = 0; i < count; ++i) {
      std::string which = std::string(what) + " " + std::to_string(i) + " (" + specs[i].name + ")";
      auto tag = tag_of(i);
      if (!tag.ok() || *tag != Tag::Tensor)
        throw UsageError("graph " + graph.name + ": " + which + " of " + graph.file + " is not a tensor");
      auto info = info_of(i);
      if (!info.ok())
        throw UsageError("graph " + graph.name + ": " + which + " of " + graph.file + " has no tensor metadata");
      if (info->scalar_type() != executorch::aten::ScalarType::Float)
        throw UsageError("graph " + graph.name + ": " + which + " of " + graph.file + " is not float32");
      auto sizes = info->sizes();
      std::vector<int32_t> actual(sizes.begin(), sizes.end());
      if (actual != specs[i].shape)
        throw UsageError("graph " + graph.name + ": " + which + " of " + graph.file + " has shape " +
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

class Loader {
 public:
  explicit Loader(const std::string& mode)
      : mode_(mode == "file" ? Module::LoadMode::File : Module::LoadMode::Mmap) {}

  // Open the program (fully verified: a corrupt flatbuffer is refused, not walked), check its signature against the
  // manifest, and initialise its forward method: the delegate (XNNPACK) packs its weights here.
  std::unique_ptr<Module> load(const Graph& graph) {
    set_phase("loading " + graph.file);
    auto start = Clock::now();
    auto module = std::make_unique<Module>(graph.path, mode_);
    auto status = module->load(executorch::runtime::Program::Verification::InternalConsistency);
    if (status != executorch::runtime::Error::Ok)
      throw UsageError("graph " + graph.name + ": " + graph.file + " is not a valid ExecuTorch program " +
                       runtime_error_text(status) + "; re-export the bundle");
    check_signature(*module, graph);
    double program_ms = ms_since(start);
    auto method_start = Clock::now();
    status = module->load_forward();
    if (status != executorch::runtime::Error::Ok)
      throw UsageError("graph " + graph.name + ": initialising " + graph.file + " failed " + runtime_error_text(status) +
                       "; re-export the bundle with this ExecuTorch version");
    events.push_back({graph.name, graph.bytes, ms_since(start), program_ms, ms_since(method_start)});
    bytes_loaded += graph.bytes;
    set_phase("running");
    return module;
  }

  std::vector<LoadEvent> events;
  int64_t bytes_loaded = 0;

 private:
  Module::LoadMode mode_;
};

// Run forward on float32 inputs (each buffer exactly its spec's size); copy the float32 outputs out (the module's
// output buffers are reused on the next run), each checked against its spec's size.
std::vector<std::vector<float>> run(Module& module, const Graph& graph, std::vector<std::pair<float*, size_t>> inputs) {
  if (inputs.size() != graph.inputs.size())
    throw std::logic_error("graph " + graph.name + " fed " + std::to_string(inputs.size()) + " inputs");
  std::vector<executorch::extension::TensorPtr> tensors;
  std::vector<EValue> values;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (static_cast<int64_t>(inputs[i].second) != graph.inputs[i].numel)
      throw std::runtime_error("graph " + graph.name + ": input " + std::to_string(i) + " has " +
                               std::to_string(inputs[i].second) + " values, not " +
                               std::to_string(graph.inputs[i].numel));
    tensors.push_back(executorch::extension::from_blob(inputs[i].first, graph.inputs[i].shape));
    values.emplace_back(*tensors.back());
  }
  auto result = module.forward(values);
  if (!result.ok())
    throw std::runtime_error("running " + graph.file + " failed " + runtime_error_text(result.error()));
  if (result->size() != graph.outputs.size())
    throw std::runtime_error(graph.file + " returned " + std::to_string(result->size()) + " outputs, not " +
                             std::to_string(graph.outputs.size()));
  std::vector<std::vector<float>> outputs;
  for (size_t i = 0; i < result->size(); ++i) {
    const EValue& value = (*result)[i];
    if (!value.isTensor()) throw std::runtime_error(graph.file + ": output " + std::to_string(i) + " is not a tensor");
    const auto& tensor = value.toTensor();
    if (tensor.scalar_type() != executorch::aten::ScalarType::Float ||
        static_cast<int64_t>(tensor.numel()) != graph.outputs[i].numel)
      throw std::runtime_error(graph.file + ": output " + std::to_string(i) + " (" + graph.outputs[i].name + ") has " +
                               std::to_string(tensor.numel()) + " values, not the " +
                               std::to_string(graph.outputs[i].numel) + " float32 values of its spec");
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
// The caller has checked probs holds num_experts values and 1 <= k <= num_experts; a corrupt graph can still emit
// NaN, which would break the sort's ordering, so non-finite probabilities are an error.
void pick_experts(const std::vector<float>& probs, int k, bool renormalize, Inference& out) {
  if (k < 1 || static_cast<size_t>(k) > probs.size())
    throw std::logic_error("top_k " + std::to_string(k) + " with " + std::to_string(probs.size()) + " experts");
  for (float p : probs)
    if (!std::isfinite(p)) throw std::runtime_error("the router produced a non-finite probability (a corrupt graph?)");
  std::vector<int> order(probs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return probs[a] > probs[b]; });
  float total = 0;
  for (int i = 0; i < k; ++i) {
    out.experts.push_back(order[i]);
    out.gates.push_back(probs[order[i]]);
    total += probs[order[i]];
  }
  if (renormalize && total > 0)
    for (auto& gate : out.gates) gate /= total;
}

// An output looked up by name (validated to exist when the bundle was read).
std::vector<float>& named_output(std::vector<std::vector<float>>& outputs, const Graph& graph, const char* name) {
  int index = graph.output(name);
  if (index < 0 || static_cast<size_t>(index) >= outputs.size())
    throw std::logic_error("graph " + graph.name + " has no output " + name);
  return outputs[index];
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

  Inference infer(std::vector<float>& image) {
    Inference out;
    auto start = Clock::now();
    const Graph& first = bundle_.first();
    auto outputs = run(*first_, first, {{image.data(), image.size()}});
    if (bundle_.kind != "split") {
      out.logits = named_output(outputs, first, "logits");
      if (bundle_.kind == "monolithic")
        pick_experts(named_output(outputs, first, "router_probs"), bundle_.top_k, bundle_.renormalize_gates, out);
      out.total_ms = out.router_ms = ms_since(start);
      return out;
    }
    std::vector<float>& tokens = named_output(outputs, first, "tokens");
    pick_experts(named_output(outputs, first, "router_probs"), bundle_.top_k, bundle_.renormalize_gates, out);
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
    out.logits = bundle_.layout == "per-block" ? run_blocks(tokens, out.experts, chosen, out.gates)
                                               : run_path(*chosen[0]->at(0), out.experts[0], tokens, out.gates[0]);
    out.expert_ms = ms_since(expert_start) - out.load_ms;
    out.total_ms = ms_since(start);
    return out;
  }

  // The router's tokens for one image.
  std::vector<float> route(std::vector<float>& image) {
    auto outputs = run(*first_, bundle_.router, {{image.data(), image.size()}});
    return named_output(outputs, bundle_.router, "tokens");
  }

  // One chosen expert's computation on given tokens: what an expert switch has to wait for after loading.
  std::vector<float> run_expert(int expert, std::vector<std::unique_ptr<Module>>& modules, std::vector<float> tokens) {
    std::vector<std::vector<std::unique_ptr<Module>>*> chosen{&modules};
    return bundle_.layout == "per-block" ? run_blocks(tokens, {expert}, chosen, {1.0f})
                                         : run_path(*modules[0], expert, tokens, 1.0f);
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
    const Graph& graph = bundle_.experts.at(expert).at(0);
    auto outputs = run(module, graph, {{tokens.data(), tokens.size()}, {&gate, 1}});
    return named_output(outputs, graph, "logits");
  }

  // x = tokens; per block: residual, normed = shared(x); x = residual + sum_j gate_j * expert_j(normed); head(x).
  std::vector<float> run_blocks(std::vector<float> x, const std::vector<int>& experts,
                                std::vector<std::vector<std::unique_ptr<Module>>*>& chosen,
                                const std::vector<float>& gates) {
    for (size_t block = 0; block < shared_.size(); ++block) {
      auto halves = run(*shared_[block], bundle_.shared[block], {{x.data(), x.size()}});
      x = halves.at(0);  // residual
      std::vector<float>& normed = halves.at(1);
      for (size_t j = 0; j < chosen.size(); ++j) {
        const Graph& graph = bundle_.experts.at(experts.at(j)).at(block);
        auto delta = run(*chosen[j]->at(block), graph, {{normed.data(), normed.size()}}).at(0);
        if (delta.size() != x.size()) throw std::runtime_error(graph.file + " returned a delta of the wrong size");
        for (size_t i = 0; i < x.size(); ++i) x[i] += gates.at(j) * delta[i];
      }
    }
    auto outputs = run(*head_, bundle_.head, {{x.data(), x.size()}});
    return named_output(outputs, bundle_.head, "logits");
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Inputs, statistics, memory

std::vector<std::vector<float>> read_images(const Options& options, const Bundle& bundle) {
  size_t per_image = 1;
  for (size_t i = 1; i < bundle.image_shape.size(); ++i) per_image *= static_cast<size_t>(bundle.image_shape[i]);
  std::vector<std::vector<float>> images;
  if (!options.input_path.empty()) {
    std::string raw = read_file(options.input_path, "--input", uint64_t{1} << 32);
    if (raw.empty() || raw.size() % (per_image * sizeof(float)) != 0)
      throw UsageError(options.input_path + " holds " + std::to_string(raw.size()) +
                       " bytes, not a whole number of float32 images of " + std::to_string(per_image) + " values");
    for (size_t offset = 0; offset < raw.size(); offset += per_image * sizeof(float)) {
      images.emplace_back(per_image);
      std::memcpy(images.back().data(), raw.data() + offset, per_image * sizeof(float));
    }
    return images;
  }
  if (static_cast<double>(options.random_images) * static_cast<double>(per_image) * sizeof(float) > 4294967296.0)
    throw UsageError("--random " + std::to_string(options.random_images) + " images of " + std::to_string(per_image) +
                     " values need more than 4 GiB; ask for fewer");
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
  set_phase("reading the bundle " + options.bundle);
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
    Inference result = pipeline.infer(image);
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
  for (int i = 0; i < options.warmup; ++i) pipeline.infer(images[i % images.size()]);
  std::vector<double> total, router, expert, loads;
  for (int i = 0; i < options.iterations; ++i) {
    Inference result = pipeline.infer(images[i % images.size()]);
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
    std::vector<float> tokens = pipeline.route(images[0]);  // real tokens, so the expert sees real input
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

namespace {

// One line: newlines and other control characters in a message (a file name, a runtime log) become spaces.
std::string one_line(std::string text) {
  for (char& c : text)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  return text;
}

// --sha256 FILE...: print "DIGEST  FILE" per file (sha256sum's format), so the tests can compare with hashlib.
int print_digests(int argc, char** argv) {
  if (argc < 3) throw UsageError("--sha256 needs at least one file");
  for (int i = 2; i < argc; ++i) {
    std::string digest;
    uint64_t size = 0;
    if (!mobile_moe::sha256::file_digest(argv[i], &digest, &size)) throw UsageError(std::string("cannot read ") + argv[i]);
    std::printf("%s  %s\n", digest.c_str(), argv[i]);
  }
  return 0;
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
void on_fatal_signal(int signal) {
  char line[512];
  int length = std::snprintf(line, sizeof(line), "mobile_moe_runner: crashed (signal %d) while %s\n", signal, g_phase);
  if (length > 0) {
    ssize_t ignored = write(STDERR_FILENO, line, static_cast<size_t>(std::min<int>(length, sizeof(line) - 1)));
    (void)ignored;
  }
  std::signal(signal, SIG_DFL);
  std::raise(signal);
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

int main(int argc, char** argv) {
  g_debug = std::getenv("MOBILE_MOE_DEBUG") != nullptr && std::string(std::getenv("MOBILE_MOE_DEBUG")) == "1";
  install_fatal_signal_handlers();
  // ExecuTorch logs through its platform layer; route it to capture_log (stderr stays the runner's one line).
  executorch::runtime::register_pal(executorch::runtime::PalImpl::create(capture_log, __FILE__));
  try {
    if (argc >= 2 && std::string(argv[1]) == "--sha256") return print_digests(argc, argv);
    Options options = parse_options(argc, argv);
    std::string report = measure(options);
    std::fwrite(report.data(), 1, report.size(), stdout);
    std::fputc('\n', stdout);
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
