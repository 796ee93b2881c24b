// bundle_manifest.h: the parser. It reads a manifest.json by the one manifest schema's rules (the words, names and
// bounds of manifest_schema.h), checks its files and resolves it to a Bundle; the one C++ file that reads the
// manifest's words (tests/test_docs.py holds every other one to manifest_schema.h's enums).
#include "bundle_manifest.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "errors.h"
#include "file_identity.h"
#include "flatbuffer_check.h"
#include "json_reader.h"
#include "manifest_schema.h"
#include "manifest_values.h"
#include "preprocess.h"
#include "runtime_log.h"
#include "sha256.h"
#include "staged_files.h"

namespace mobile_moe::library {

// The layouts each routing kind exports as (mobile_moe/export/manifest_schema.py LAYOUTS_OF_ROUTING, in
// manifest_schema.h).
static bool layout_fits_routing(Routing routing, Layout layout) {
  return kLayoutFitsRouting[static_cast<int>(routing)][static_cast<int>(layout)];
}

// a + b for counts in [0, kMaxCount + 1], held at kMaxCount + 1 (more than any valid count) instead of overflowing:
// 2^16 graphs of up to 2^62 parameters each would overflow int64.
static int64_t add_counts(int64_t a, int64_t b) { return a > kMaxCount - b ? kMaxCount + 1 : a + b; }

int Graph::output(const std::string& wanted) const {
  for (size_t i = 0; i < outputs.size(); ++i)
    if (outputs[i].name == wanted) return static_cast<int>(i);
  return -1;
}

int64_t Bundle::expert_bytes(int e) const {
  int64_t total = 0;
  for (const auto& graph : experts[e]) total += graph.load_bytes();
  return total;
}

static std::string real_path(const std::string& path) {
  char resolved[PATH_MAX];
  if (realpath(path.c_str(), resolved) == nullptr) return "";
  return resolved;
}

// A regular file no larger than max_bytes, read whole; UsageError naming `what` otherwise.
static std::string read_file(const std::string& path, const std::string& what, uint64_t max_bytes) {
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

std::string shape_text(const std::vector<int32_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// A shape: 1..kMaxRank dimensions of 1..kMaxDim, at most kMaxElements elements (the product cannot overflow: checked
// as it grows).
static std::vector<int32_t> shape_of(const json::Value& value, const std::string& where, size_t min_dims,
                                     size_t max_dims, int64_t* numel) {
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

static Spec spec_of(const json::Value& value, const std::string& where) {
  Spec spec;
  spec.name = as_str(object_at(value, where, "name"), child(where, "name"), 1, kMaxName);
  spec.shape = shape_of(object_at(value, where, "shape"), child(where, "shape"), 1, kMaxRank, &spec.numel);
  if (as_str(object_at(value, where, "dtype"), child(where, "dtype"), 0, kMaxName) != kTensorDtype)
    invalid(child(where, "dtype"), std::string("must be \"") + kTensorDtype + "\"");
  return spec;
}

static bool is_hex_digest(const std::string& text) {
  if (text.size() != sha256::kHexDigits) return false;
  for (char c : text)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

// A path a graph names: relative, inside the bundle (a bundle is untrusted input on a phone), a regular file.
// Whether relative `file` climbs above its folder by its own ".." components (whether or not what it names exists).
static bool climbs_out(const std::string& file) {
  int depth = 0;
  for (size_t start = 0; start <= file.size();) {
    size_t end = file.find('/', start);
    if (end == std::string::npos) end = file.size();
    const std::string part = file.substr(start, end - start);
    if (part == "..") {
      if (--depth < 0) return true;
    } else if (!part.empty() && part != ".") {
      ++depth;
    }
    start = end + 1;
  }
  return false;
}

static std::string path_in_bundle(const std::string& graph, const std::string& file, const std::string& dir) {
  if (file[0] == '/') throw UsageError("graph " + graph + ": file " + file + " must be a path relative to the bundle");
  if (climbs_out(file))
    throw UsageError("graph " + graph + ": file " + file + " leaves the bundle directory; refusing it");
  std::string path = real_path(dir + "/" + file);
  if (path.empty())
    throw UsageError("graph " + graph + ": file " + file + " named in the manifest is missing; re-export the bundle");
  if (path.compare(0, dir.size() + 1, dir + "/") != 0)
    throw UsageError("graph " + graph + ": file " + file + " leaves the bundle directory; refusing it");
  struct stat info {};
  if (stat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode))
    throw UsageError("graph " + graph + ": file " + file + " is not a regular file");
  return path;
}

// {file, sha256, bytes} at `where` (a graph entry, or its `weights` object), its path resolved inside the bundle.
static File file_from(const json::Value& object, const std::string& where, const std::string& graph,
                      const std::string& dir) {
  File file;
  file.file = as_str(object_at(object, where, "file"), child(where, "file"), 1, kMaxPath);
  file.sha256 = as_str(object_at(object, where, "sha256"), child(where, "sha256"), 0, sha256::kHexDigits);
  if (!is_hex_digest(file.sha256))
    invalid(child(where, "sha256"), "must be " + std::to_string(sha256::kHexDigits) + " lowercase hex digits");
  file.bytes = as_int(object_at(object, where, "bytes"), child(where, "bytes"), 0, kMaxCount);
  file.path = path_in_bundle(graph, file.file, dir);
  return file;
}

static Graph graph_from(const json::Value& entry, const std::string& where, const std::string& dir) {
  Graph graph;
  graph.name = as_str(object_at(entry, where, "name"), child(where, "name"), 1, kMaxName);
  graph.role = one_of(object_at(entry, where, "role"), child(where, "role"), kRoles);
  const json::Value& expert = object_at(entry, where, "expert");  // required, may be null
  graph.expert = expert.is_null() ? -1 : static_cast<int>(as_int(expert, child(where, "expert"), 0, kMaxExperts - 1));
  if (const json::Value* block = optional_at(entry, where, "block"))
    as_int(*block, child(where, "block"), 0, kMaxBlock);
  graph.params = as_int(object_at(entry, where, "params"), child(where, "params"), 0, kMaxCount);
  const auto& inputs = as_array(object_at(entry, where, "inputs"), child(where, "inputs"), 1, kMaxTensors);
  for (size_t i = 0; i < inputs.size(); ++i) graph.inputs.push_back(spec_of(inputs[i], child(child(where, "inputs"), i)));
  const auto& outputs = as_array(object_at(entry, where, "outputs"), child(where, "outputs"), 1, kMaxTensors);
  for (size_t i = 0; i < outputs.size(); ++i)
    graph.outputs.push_back(spec_of(outputs[i], child(child(where, "outputs"), i)));
  for (const auto& spec : graph.inputs) graph.input_shapes.push_back(spec.shape);
  graph.program = file_from(entry, where, graph.name, dir);
  if (const json::Value* weights = optional_at(entry, where, "weights")) {
    std::string at = child(where, "weights");
    if (!weights->is_object()) invalid(at, "must be an object {file, sha256, bytes}, not " + json::describe(*weights));
    graph.weights = file_from(*weights, at, graph.name, dir);
    if (graph.weights.file == graph.program.file) invalid(child(at, "file"), "is the graph's program file");
  }
  return graph;
}

static void expect_shape(const Graph& graph, const Spec* spec, const std::vector<int32_t>& expected,
                         const std::string& what) {
  if (spec == nullptr) invalid("graph " + graph.name, "has no " + what + "; it must have shape " + shape_text(expected));
  if (spec->shape != expected)
    invalid("graph " + graph.name, what + " shape " + shape_text(spec->shape) + " must be " + shape_text(expected));
}
static const Spec* output_spec(const Graph& graph, const std::string& name) {
  int index = graph.output(name);
  return index < 0 ? nullptr : &graph.outputs[index];
}
static void expect_inputs(const Graph& graph, const std::vector<std::vector<int32_t>>& expected) {
  if (graph.input_shapes != expected) {
    std::string want;
    for (const auto& shape : expected) want += (want.empty() ? "" : ", ") + shape_text(shape);
    invalid("graph " + graph.name, "inputs must have shapes " + want);
  }
}

// input.resize: the eval resize policy an image's pixels take (mobile_moe/preprocess.py; preprocess.cpp for an app's
// pixels), checked by the schema's rules (mobile_moe/export/manifest_schema.py ResizeSpec): a known policy and origin, no unknown key, stretch
// without sizes, resize-center-crop with resize_to >= crop_to = S, an optional known interpolation.
// The words: manifest_schema.h's kResizePolicies, kResizeOrigins, kInterpolations.

static void check_resize(const json::Value& input, int64_t image_size, Preprocessing& pre) {
  const json::Value& resize = object_at(input, "input", "resize");
  if (!resize.is_object()) invalid("input.resize", "must be an object, not " + shown(resize));
  for (const auto& entry : resize.object)
    if (entry.first != "policy" && entry.first != "resize_to" && entry.first != "crop_to" && entry.first != "origin" &&
        entry.first != "interpolation")
      invalid("input.resize", "has an unknown key \"" + entry.first.substr(0, 40) + "\"");
  const auto policy =
      one_of<ResizePolicy>(object_at(resize, "input.resize", "policy"), "input.resize.policy", kResizePolicies);
  if (const json::Value* origin = optional_at(resize, "input.resize", "origin"))
    one_of(*origin, "input.resize.origin", kResizeOrigins);
  if (const json::Value* interpolation = optional_at(resize, "input.resize", "interpolation"))
    pre.interpolation = one_of<Interpolation>(*interpolation, "input.resize.interpolation", kInterpolations);
  pre.policy = policy;
  const json::Value* resize_to = optional_at(resize, "input.resize", "resize_to");
  const json::Value* crop_to = optional_at(resize, "input.resize", "crop_to");
  if (policy == ResizePolicy::Stretch) {
    if (resize_to != nullptr || crop_to != nullptr)
      invalid("input.resize", std::string("the ") + name(policy) +
                                  " policy resizes to the input size and takes no resize_to or crop_to");
    return;
  }
  if (resize_to == nullptr || crop_to == nullptr)
    invalid("input.resize", std::string("the ") + name(policy) + " policy needs resize_to and crop_to");
  int64_t resize_side = as_int(*resize_to, "input.resize.resize_to", 1, kMaxDim);
  int64_t crop_side = as_int(*crop_to, "input.resize.crop_to", 1, kMaxDim);
  if (resize_side < crop_side)
    invalid("input.resize", "resize_to " + std::to_string(resize_side) + " is smaller than crop_to " +
                                std::to_string(crop_side) + ": the crop must fit in");
  if (crop_side != image_size)
    invalid("input.resize.crop_to",
            std::to_string(crop_side) + " must be the input size " + std::to_string(image_size));
  pre.resize_to = static_cast<int>(resize_side);
  pre.crop_to = static_cast<int>(crop_side);
}

namespace {

// What the layout checks share: the manifest's parts, the graphs by name, and the shapes every layout compares
// against (mobile_moe/export/manifest_schema.py: _named, _check_experts_and_k, _check_router).
struct LayoutCheck {
  const json::Value& model;
  const json::Value& composition;
  std::map<std::string, Graph> graphs;
  Bundle& bundle;
  int64_t num_classes;

  std::vector<int32_t> logits_shape() const { return {1, static_cast<int32_t>(num_classes)}; }
  std::vector<int32_t> probs_shape() const { return {1, static_cast<int32_t>(bundle.num_experts)}; }

  const Graph& named(const json::Value* value, const std::string& role, const std::string& what) const {
    std::string where = "composition." + what;
    if (value == nullptr) invalid(where, "names no graph");
    std::string name = as_str(*value, where, 1, kMaxName);
    auto found = graphs.find(name);
    if (found == graphs.end()) invalid(where, "names graph \"" + name + "\", which is not in graphs");
    if (found->second.role != role)
      invalid(where, "graph \"" + name + "\" has role " + found->second.role + ", expected " + role);
    return found->second;
  }

  void check_experts_and_k(int k_min, int k_max) const {
    if (bundle.num_experts < 1) invalid("num_experts", "an MoE bundle needs at least 1 expert");
    if (const json::Value* model_experts = optional_at(model, "model", "num_experts"))
      if (!model_experts->is_number() || !model_experts->integral || model_experts->whole != bundle.num_experts)
        invalid("num_experts", std::to_string(bundle.num_experts) + " differs from the model's " + shown(*model_experts));
    if (bundle.top_k < k_min || bundle.top_k > k_max)
      invalid("top_k", std::to_string(bundle.top_k) + " must be between " + std::to_string(k_min) + " and " +
                           std::to_string(k_max) + " for the " + name(bundle.layout) + " layout");
  }

  // The router: images -> router_probs (1, E) and tokens (1, T, D); -> the tokens' shape.
  std::vector<int32_t> check_router() const {
    bundle.router = named(optional_at(composition, "composition", "router"), "router", "router");
    const Graph& router = bundle.router;
    if (router.inputs.size() != 1) invalid("graph " + router.name, "needs exactly one input (images)");
    expect_shape(router, &router.inputs[0], bundle.image_shape, "input");
    expect_shape(router, output_spec(router, "router_probs"), probs_shape(), "router_probs");
    const Spec* tokens = output_spec(router, "tokens");
    if (tokens == nullptr || tokens->shape.size() != 3 || tokens->shape[0] != 1)
      invalid("graph " + router.name, "needs a tokens output of shape (1, T, D)");
    return tokens->shape;
  }

  void check_listed_expert(const Graph& expert, int e) const {
    if (expert.expert != e)
      invalid("graph " + expert.name, "is listed as expert " + std::to_string(e) + " but says expert " +
                                          std::to_string(expert.expert));
  }
};

}  // namespace

// The manifest's format version, worded as mobile_moe/formats/versions.py words it for every format: none (a
// manifest that states no version), an older one and a newer one each say what to do.
static void check_version(const json::Value* stated) {
  const std::string reads = "; this library reads version " + std::to_string(kVersion) + ": ";
  const std::string again = "export the bundle again with `mobile-moe export`";
  if (stated == nullptr) invalid("version", "the bundle is of format version 0 (it states none)" + reads + again);
  const int64_t version = as_int(*stated, "version", INT64_MIN, INT64_MAX);
  if (version > kVersion)
    invalid("version", "the bundle is of format version " + std::to_string(version) +
                           " (written by a newer mobile-moe)" + reads + "upgrade libmobile_moe, or " + again);
  if (version != kVersion)
    invalid("version", "the bundle is of format version " + std::to_string(version) + reads + again);
}

// format, version, backend (ExecuTorch only), and the model's summary; -> the model's number of classes.
static int64_t check_header_and_model(const json::Value& manifest, Bundle& bundle, int64_t* image_size,
                                      int64_t* in_chans) {
  if (!manifest.is_object()) invalid("manifest", "must be a JSON object, not " + json::describe(manifest));
  const json::Value& format = object_at(manifest, "", "format");
  if (!format.is_string() || format.string != kFormat) invalid("format", std::string("must be \"") + kFormat + "\"");
  check_version(optional_at(manifest, "", "version"));
  const std::string& backend = one_of(object_at(manifest, "", "backend"), "backend", kBackends);
  if (backend != "executorch")
    throw UsageError("libmobile_moe runs ExecuTorch bundles; this is a " + backend + " bundle");

  const json::Value& model = object_at(manifest, "", "model");
  as_str(object_at(model, "model", "name"), "model.name", 1, kMaxName);
  *image_size = as_int(object_at(model, "model", "image_size"), "model.image_size", 1, kMaxDim);
  *in_chans = as_int(object_at(model, "model", "in_chans"), "model.in_chans", 1, kMaxChannels);
  int64_t num_classes = as_int(object_at(model, "model", "num_classes"), "model.num_classes", 1, kMaxClasses);
  if (const json::Value* renormalize = optional_at(model, "model", "renormalize_gates"))
    bundle.renormalize_gates = as_bool(*renormalize, "model.renormalize_gates");
  else if (model.has("renormalize_gates"))
    invalid("model.renormalize_gates", "must be true or false, not null");
  bundle.num_experts = static_cast<int>(as_int(object_at(manifest, "", "num_experts"), "num_experts", 0, kMaxExperts));
  bundle.top_k = static_cast<int>(as_int(object_at(manifest, "", "top_k"), "top_k", 0, kMaxExperts));
  return num_classes;
}

// input: (1, C, S, S) float32 as the model's, one mean and std per channel, the resize policy.
static void check_input(const json::Value& manifest, Bundle& bundle, int64_t image_size, int64_t in_chans) {
  const json::Value& input = object_at(manifest, "", "input");
  int64_t image_numel = 0;
  bundle.image_shape = shape_of(object_at(input, "input", "shape"), "input.shape", 4, 4, &image_numel);
  if (as_str(object_at(input, "input", "dtype"), "input.dtype", 0, kMaxName) != kTensorDtype)
    invalid("input.dtype", std::string("must be \"") + kTensorDtype + "\"");
  const auto& mean = as_array(object_at(input, "input", "mean"), "input.mean", 0, kMaxChannels);
  const auto& std_dev = as_array(object_at(input, "input", "std"), "input.std", 0, kMaxChannels);
  for (size_t i = 0; i < mean.size(); ++i) bundle.input.mean.push_back(as_finite(mean[i], child("input.mean", i)));
  for (size_t i = 0; i < std_dev.size(); ++i) {
    bundle.input.std.push_back(as_finite(std_dev[i], child("input.std", i)));
    if (bundle.input.std.back() <= 0) invalid(child("input.std", i), "must be greater than 0");
  }
  const auto& shape = bundle.image_shape;
  if (shape[0] != 1 || shape[1] > kMaxChannels || shape[2] != shape[3])
    invalid("input.shape", shape_text(shape) + " must be (1, C, S, S) with C <= " + std::to_string(kMaxChannels));
  if (mean.size() != static_cast<size_t>(shape[1]) || std_dev.size() != static_cast<size_t>(shape[1]))
    invalid("input", "mean and std need " + std::to_string(shape[1]) + " values (one per channel)");
  std::vector<int32_t> model_shape{1, static_cast<int32_t>(in_chans), static_cast<int32_t>(image_size),
                                   static_cast<int32_t>(image_size)};
  if (shape != model_shape)
    invalid("input.shape", shape_text(shape) + " differs from the model's " + shape_text(model_shape));
  check_resize(input, shape[2], bundle.input);
}

static void check_class_names(const json::Value& manifest, int64_t num_classes, Bundle& bundle) {
  const auto& class_names = as_array(object_at(manifest, "", "class_names"), "class_names", 0, kMaxClasses);
  std::set<std::string> seen;
  for (size_t i = 0; i < class_names.size(); ++i) {  // mobile_moe/utils/class_names.py class_names_problem's rule
    const std::string& name = as_str(class_names[i], child("class_names", i), 1, kMaxLabel);
    if (name.find_first_not_of(" \t") == std::string::npos) invalid(child("class_names", i), "is blank");
    if (has_control_character(name))
      invalid(child("class_names", i), "holds a control character (a NUL, newline, tab or escape): rename it");
    if (!seen.insert(name).second) invalid(child("class_names", i), "\"" + name + "\" appears more than once");
    bundle.class_names.push_back(name);
  }
  if (static_cast<int64_t>(class_names.size()) != num_classes)
    invalid("class_names", std::to_string(class_names.size()) + " names for a model with " +
                               std::to_string(num_classes) + " classes");
  if (const json::Value* names = optional_at(manifest, "", "super_class_names")) {
    const auto& items = as_array(*names, "super_class_names", 0, kMaxClasses);
    for (size_t i = 0; i < items.size(); ++i) as_str(items[i], child("super_class_names", i), 0, kMaxLabel);
  }
}

// Graphs: unique names, each entry well-formed and its file inside the bundle.
static std::map<std::string, Graph> read_graphs(const json::Value& manifest, Bundle& bundle) {
  std::map<std::string, Graph> graphs;
  const auto& entries = as_array(object_at(manifest, "", "graphs"), "graphs", 1, kMaxGraphs);
  for (size_t i = 0; i < entries.size(); ++i) {
    Graph graph = graph_from(entries[i], child("graphs", i), bundle.dir);
    if (graphs.count(graph.name)) invalid("graphs", "two graphs are named \"" + graph.name + "\"");
    graphs[graph.name] = graph;
    bundle.all.push_back(graph);
  }
  return graphs;
}

// dense, monolithic, whole: one graph, images -> logits (+ router_probs, or expert_tokens).
static void check_single_graph(const LayoutCheck& check) {
  Bundle& bundle = check.bundle;
  const std::string layout = name(bundle.layout);  // the single-graph layouts' one graph has the layout's role
  if (check.graphs.size() != 1 || bundle.all.size() != 1 || bundle.all[0].role != layout)
    invalid("graphs", "a " + layout + " bundle holds exactly one graph with role " + layout);
  bundle.single = bundle.all[0];
  const Graph& single = bundle.single;
  if (single.inputs.size() != 1) invalid("graph " + single.name, "needs exactly one input (images)");
  expect_shape(single, &single.inputs[0], bundle.image_shape, "input");
  expect_shape(single, output_spec(single, "logits"), check.logits_shape(), "logits");
  if (bundle.layout == Layout::Dense) {
    if (bundle.num_experts != 0 || bundle.top_k != 0) invalid("num_experts", "a dense bundle has num_experts 0 and top_k 0");
  } else if (bundle.layout == Layout::Monolithic) {
    check.check_experts_and_k(1, bundle.num_experts);
    expect_shape(single, output_spec(single, "router_probs"), check.probs_shape(), "router_probs");
  } else {  // whole: top_k is per token (0 where the model has none); the runner picks nothing
    check.check_experts_and_k(0, bundle.num_experts);
    const Spec* tokens = output_spec(single, "expert_tokens");  // (1, G, E): G expert sets
    int32_t sets = tokens != nullptr && tokens->shape.size() == 3 ? tokens->shape[1] : 1;
    expect_shape(single, tokens, {1, sets, static_cast<int32_t>(bundle.num_experts)}, "expert_tokens");
  }
}

// expert-paths (k = 1): router; expert e = one graph (tokens, gate) -> logits.
static void check_expert_paths(const LayoutCheck& check) {
  Bundle& bundle = check.bundle;
  check.check_experts_and_k(1, 1);
  std::vector<int32_t> tokens = check.check_router();
  if (const json::Value* tail = optional_at(check.composition, "composition", "trunk_tail");
      tail != nullptr && !tail->is_null()) {
    bundle.trunk_tail = check.named(tail, "trunk_tail", "trunk_tail");
    expect_inputs(bundle.trunk_tail, {tokens});
    if (bundle.trunk_tail.outputs.size() != 1 || bundle.trunk_tail.outputs[0].shape != tokens)
      invalid("graph " + bundle.trunk_tail.name, "needs one output of shape " + shape_text(tokens));
  }
  const json::Value* names = optional_at(check.composition, "composition", "experts");
  const auto& listed = names == nullptr ? std::vector<json::Value>{} : as_array(*names, "composition.experts", 0, kMaxExperts);
  if (static_cast<int64_t>(listed.size()) != bundle.num_experts)
    invalid("composition.experts", "names " + std::to_string(listed.size()) + " graphs for " +
                                       std::to_string(bundle.num_experts) + " experts");
  for (int e = 0; e < bundle.num_experts; ++e) {
    const Graph& expert = check.named(&listed[e], "expert", "experts." + std::to_string(e));
    check.check_listed_expert(expert, e);
    expect_inputs(expert, {tokens, {1, 1}});
    expect_shape(expert, output_spec(expert, "logits"), check.logits_shape(), "logits");
    bundle.experts[e] = {expert};
  }
}

// per-block (any k): router, per MoE block a shared graph and one MLP graph per expert, then the head.
static void check_per_block(const LayoutCheck& check) {
  Bundle& bundle = check.bundle;
  check.check_experts_and_k(1, bundle.num_experts);
  std::vector<int32_t> tokens = check.check_router();
  const json::Value* blocks = optional_at(check.composition, "composition", "blocks");
  if (blocks == nullptr || as_array(*blocks, "composition.blocks", 0, kMaxBlock + 1).empty())
    invalid("composition.blocks", "a per-block bundle needs composition.blocks");
  for (size_t b = 0; b < blocks->array.size(); ++b) {
    const json::Value& block = blocks->array[b];
    std::string where = child("composition.blocks", b);
    const Graph& shared =
        check.named(&object_at(block, where, "shared"), "block_shared", "blocks." + std::to_string(b) + ".shared");
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
          check.named(&listed[e], "block_expert", "blocks." + std::to_string(b) + ".experts." + std::to_string(e));
      check.check_listed_expert(expert, e);
      expect_inputs(expert, {tokens});
      if (expert.outputs.size() != 1 || expert.outputs[0].shape != tokens)
        invalid("graph " + expert.name, "needs one output of shape " + shape_text(tokens));
      bundle.experts[e].push_back(expert);
    }
  }
  bundle.head = check.named(optional_at(check.composition, "composition", "head"), "head", "head");
  expect_inputs(bundle.head, {tokens});
  expect_shape(bundle.head, output_spec(bundle.head, "logits"), check.logits_shape(), "logits");
}

// Everything the schema checks but the routing and parameter rules (types, ranges, layout rules), then the runner's
// own needs: the parts in the schema's order, then the layout's own rules.
static void validate_layout(const json::Value& manifest, Bundle& bundle) {
  int64_t image_size = 0, in_chans = 0;
  int64_t num_classes = check_header_and_model(manifest, bundle, &image_size, &in_chans);
  check_input(manifest, bundle, image_size, in_chans);
  check_class_names(manifest, num_classes, bundle);
  std::map<std::string, Graph> graphs = read_graphs(manifest, bundle);
  const json::Value& composition = object_at(manifest, "", "composition");
  bundle.layout = one_of<Layout>(object_at(composition, "composition", "layout"), "composition.layout", kLayouts);
  bundle.kind = kKindOfLayout[static_cast<int>(bundle.layout)];
  LayoutCheck check{object_at(manifest, "", "model"), composition, std::move(graphs), bundle, num_classes};
  if (const json::Value* tail = optional_at(composition, "composition", "trunk_tail");
      tail != nullptr && !tail->is_null() && bundle.layout != Layout::ExpertPaths)
    invalid("composition.trunk_tail", std::string("only an expert-paths bundle has one, not ") + name(bundle.layout));
  if (bundle.kind != Kind::Split) return check_single_graph(check);
  bundle.experts.assign(bundle.num_experts, {});
  if (bundle.layout == Layout::ExpertPaths) return check_expert_paths(check);
  check_per_block(check);
}

// Parameters held by the graphs one image needs at most (the schema's Manifest.params_loaded_max): every graph that is
// not an expert's, plus the top_k experts whose graphs hold the most.
static int64_t params_loaded_max(const Bundle& bundle) {
  int64_t loaded = 0;
  std::map<int, int64_t> per_expert;
  for (const auto& graph : bundle.all) {
    if (graph.role == "expert" || graph.role == "block_expert")
      per_expert[graph.expert] = add_counts(per_expert[graph.expert], graph.params);
    else
      loaded = add_counts(loaded, graph.params);
  }
  std::vector<int64_t> totals;
  for (const auto& entry : per_expert) totals.push_back(entry.second);
  std::sort(totals.begin(), totals.end(), [](int64_t a, int64_t b) { return a > b; });
  for (size_t i = 0; i < totals.size() && i < static_cast<size_t>(bundle.top_k); ++i) loaded = add_counts(loaded, totals[i]);
  return loaded;
}

// What an image touches: the routing kind must be one whose model exports as this layout, and params_active_max
// cannot exceed what the graphs of one image hold.
static void check_routing_and_params(const json::Value& manifest, const Bundle& bundle) {
  Routing kind = one_of<Routing>(object_at(manifest, "", "routing"), "routing", kRoutings);
  if (!layout_fits_routing(kind, bundle.layout))
    invalid("routing", std::string("a model routing by \"") + name(kind) + "\" does not export as " + name(bundle.layout));
  int64_t claimed = as_int(object_at(manifest, "", "params_active_max"), "params_active_max", 0, kMaxCount);
  int64_t loaded = params_loaded_max(bundle);
  if (claimed > loaded)
    invalid("params_active_max", std::to_string(claimed) + " is more than the " + std::to_string(loaded) +
                                     " parameters the graphs of one image hold");
  if (const json::Value* top1 = optional_at(manifest, "", "validation_top1")) {
    double value = as_finite(*top1, "validation_top1");
    if (value < 0 || value > 1) invalid("validation_top1", "must be a top-1 between 0 and 1");
  }
}

void validate(const json::Value& manifest, Bundle& bundle) {
  validate_layout(manifest, bundle);
  check_routing_and_params(manifest, bundle);
}

// Every graph file the manifest lists must have the recorded size and sha256, and be a file ExecuTorch can read
// safely (flatbuffer_check.h: a damaged file whose manifest was re-sealed), as mobile_moe/export/manifest.py checks
// them in Python: before any graph is loaded. `external_data`: the graph loads a weights file with its program.
static void verify_file(const std::string& graph, const File& file, bool external_data) {
  std::string digest;
  uint64_t size = 0;
  if (!mobile_moe::sha256::file_digest(file.path, &digest, &size))
    throw UsageError("graph " + graph + ": cannot read " + file.file);
  if (static_cast<int64_t>(size) != file.bytes || digest != file.sha256)
    throw UsageError("graph " + graph + ": " + file.file +
                     " does not match the sha256 in the manifest (tampered with or truncated); re-export the bundle");
  try {
    check_graph_file(file.path, external_data);
  } catch (const FileFault& fault) {
    throw UsageError("graph " + graph + ": " + file.file + " is damaged: " + fault.what() + "; re-export the bundle");
  }
}

VerifiedFiles::VerifiedFiles(const std::string& dir) : path_(dir.empty() ? "" : dir + "/" + kVerifiedFilesName) {
  if (path_.empty()) return;
  try {
    std::stringstream lines(read_file(path_, "verified files", kMaxBytes));
    for (std::string line; std::getline(lines, line);) known_.insert(line);
  } catch (const UsageError&) {  // none yet, or unreadable: every file is verified
  }
}

void VerifiedFiles::remember(const File& file) {
  if (!path_.empty()) added_.push_back(identity(file));
}

void VerifiedFiles::save() const {
  if (path_.empty() || added_.empty()) return;
  std::set<std::string> all(known_);
  all.insert(added_.begin(), added_.end());
  std::string text;
  size_t written = 0;
  for (const auto& line : all)  // the newest bundles' files first would need times; a bound keeps it small
    if (written++ < kMaxEntries) text += line + '\n';
  const std::string staged = staged_name(path_);
  std::string why = write_file(staged, text);
  if (why.empty() && std::rename(staged.c_str(), path_.c_str()) == 0) return;
  if (why.empty()) why = std::strerror(errno), std::remove(staged.c_str());
  library_log(MM_LOG_INFO, "cannot remember the verified bundle files in " + path_ + " (" + why +
                               "): the next open verifies them again");
}

size_t VerifiedFiles::staged_at(const std::string& name) {
  const std::string prefix = std::string(kVerifiedFilesName) + ".tmp-";
  return name.rfind(prefix, 0) == 0 ? prefix.size() - 5 : std::string::npos;
}

std::string VerifiedFiles::identity(const File& file) {
  return file.verified.known() ? file.sha256 + " " + file.verified.text() : "";
}

void verify_graph_files(Bundle& bundle, const std::string& memo_dir) {
  VerifiedFiles verified(memo_dir);
  auto verify = [&](const std::string& graph, File& file, bool external_data) {
    file.verified = identify(file.path);  // before the check: a write during it changes the identity loads compare
    if (verified.known(file)) return;
    verify_file(graph, file, external_data);
    verified.remember(file);
  };
  std::map<std::string, FileIdentity> identities;  // by path: graphs of a family share a program file
  for (auto& graph : bundle.all) {
    verify(graph.name, graph.program, graph.shares_program());
    identities[graph.program.path] = graph.program.verified;
    if (!graph.shares_program()) continue;
    verify(graph.name, graph.weights, false);
    identities[graph.weights.path] = graph.weights.verified;
  }
  verified.save();
  // The graphs that load (bundle.all holds copies): each file as it was verified, which every later load compares
  auto stamp = [&](Graph& graph) {
    for (File* file : {&graph.program, &graph.weights})
      if (auto found = identities.find(file->path); found != identities.end()) file->verified = found->second;
  };
  for (Graph* graph : {&bundle.single, &bundle.router, &bundle.trunk_tail, &bundle.head}) stamp(*graph);
  for (auto& graph : bundle.shared) stamp(graph);
  for (auto& graphs : bundle.experts)
    for (auto& graph : graphs) stamp(graph);
}

Bundle read_bundle(const std::string& path, const std::string& memo_dir) {
  Bundle bundle;
  bundle.dir = real_path(path);
  if (bundle.dir.empty()) throw UsageError("bundle directory " + path + " does not exist");
  std::string manifest_path = bundle.dir + "/" + kManifestFile;
  struct stat info {};
  if (stat(bundle.dir.c_str(), &info) == 0 && !S_ISDIR(info.st_mode))
    throw UsageError(path + " is a file: pass the bundle's folder (the one holding " + kManifestFile + ")");
  if (stat(manifest_path.c_str(), &info) != 0)
    throw UsageError(path + " has no " + kManifestFile + ": export a bundle with `mobile-moe export`");
  std::string origin = path + "/" + kManifestFile;
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
  verify_graph_files(bundle, memo_dir);
  return bundle;
}

}  // namespace mobile_moe::library
