// The ExecuTorch side of the native runner (runner.cpp): load a graph (program verified, signature checked against the
// manifest, forward method initialised), run it, keep an LRU of expert graphs, and the pipeline that takes one image
// through router -> top-k experts -> logits for every layout (or through the one graph of a dense, monolithic or
// whole bundle). Header-only, like json_reader.h.
#pragma once

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/core/error.h>
#include <executorch/runtime/executor/program.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bundle_manifest.h"
#include "errors.h"
#include "runtime_log.h"

namespace mobile_moe::runner {

using executorch::extension::Module;
using executorch::runtime::EValue;

using Clock = std::chrono::steady_clock;
inline double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
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
inline void check_signature(Module& module, const Graph& graph) {
  using executorch::runtime::Tag;
  auto meta = module.method_meta("forward");
  if (!meta.ok())
    throw UsageError("graph " + graph.name + ": " + graph.program.file + " has no forward method " +
                     runtime_error_text(meta.error()));
  auto compare = [&](const char* what, size_t count, const std::vector<Spec>& specs, auto tag_of, auto info_of) {
    if (count != specs.size())
      throw UsageError("graph " + graph.name + ": " + graph.program.file + " takes " + std::to_string(count) + " " + what +
                       " but the manifest lists " + std::to_string(specs.size()));
    for (size_t i = 0; i < count; ++i) {
      std::string which = std::string(what) + " " + std::to_string(i) + " (" + specs[i].name + ")";
      auto tag = tag_of(i);
      if (!tag.ok() || *tag != Tag::Tensor)
        throw UsageError("graph " + graph.name + ": " + which + " of " + graph.program.file + " is not a tensor");
      auto info = info_of(i);
      if (!info.ok())
        throw UsageError("graph " + graph.name + ": " + which + " of " + graph.program.file + " has no tensor metadata");
      if (info->scalar_type() != executorch::aten::ScalarType::Float)
        throw UsageError("graph " + graph.name + ": " + which + " of " + graph.program.file + " is not float32");
      auto sizes = info->sizes();
      std::vector<int32_t> actual(sizes.begin(), sizes.end());
      if (actual != specs[i].shape)
        throw UsageError("graph " + graph.name + ": " + which + " of " + graph.program.file + " has shape " +
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

// Where an ExecuTorch file says its segment data lies: {base, size} from the extended header of a program ("eh00" at
// byte 8: length, program size, segment base, segment size) or a data file ("FH01": length, flatbuffer offset and
// size, segment base, segment size); all little-endian. {0, 0} for a file without one.
inline std::pair<uint64_t, uint64_t> segment_data(const unsigned char* head) {
  auto u64 = [&](int at) {
    uint64_t value = 0;
    for (int i = 7; i >= 0; --i) value = (value << 8) | head[at + i];
    return value;
  };
  if (std::equal(head + 8, head + 12, "eh00")) return {u64(24), u64(32)};
  if (std::equal(head + 8, head + 12, "FH01")) return {u64(32), u64(40)};
  return {0, 0};
}

// Our exporter ends every ExecuTorch file with its segment data. ExecuTorch checks only that the data fits in the
// file (runtime/executor/program.cpp, Program::load; extension/flat_tensor/flat_tensor_data_map.cpp): a segment base
// moved by a re-sealed flipped byte fed the weights shifted bytes and gave NaN logits with no error. Refused here,
// as export/flatbuffer_files.py refuses it in Python.
inline void check_segment_data_ends_file(const Graph& graph, const File& file) {
  std::ifstream in(file.path, std::ios::binary);
  unsigned char head[48] = {};
  in.read(reinterpret_cast<char*>(head), sizeof head);
  if (in.gcount() != sizeof head) return;  // too short for a header: ExecuTorch refuses it
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in.tellg());
  const auto [base, length] = segment_data(head);
  if (length != 0 && (base > size || size - base != length))
    throw UsageError("graph " + graph.name + ": " + file.file + " is damaged: its segment data (" + std::to_string(base) +
                     " + " + std::to_string(length) + ") is not the end of the file (" + std::to_string(size) +
                     "); re-export the bundle");
}

class Loader {
 public:
  explicit Loader(const std::string& mode)
      : mode_(mode == "file" ? Module::LoadMode::File : Module::LoadMode::Mmap) {}

  // Open the program (fully verified: a corrupt flatbuffer is refused, not walked), check its signature against the
  // manifest, and initialise its forward method: the delegate (XNNPACK) packs its weights here.
  std::unique_ptr<Module> load(const Graph& graph) {
    set_phase("loading " + graph.program.file);
    check_segment_data_ends_file(graph, graph.program);
    if (graph.shares_program()) check_segment_data_ends_file(graph, graph.weights);
    auto start = Clock::now();
    auto module = graph.shares_program() ? std::make_unique<Module>(graph.program.path, graph.weights.path, mode_)
                                         : std::make_unique<Module>(graph.program.path, mode_);
    auto status = module->load(executorch::runtime::Program::Verification::InternalConsistency);
    if (status != executorch::runtime::Error::Ok)
      throw UsageError("graph " + graph.name + ": " + graph.program.file + " is not a valid ExecuTorch program " +
                       runtime_error_text(status) + "; re-export the bundle");
    check_signature(*module, graph);
    double program_ms = ms_since(start);
    auto method_start = Clock::now();
    status = module->load_forward();
    if (status != executorch::runtime::Error::Ok)
      throw UsageError("graph " + graph.name + ": initialising " + graph.program.file + " failed " + runtime_error_text(status) +
                       "; re-export the bundle with this ExecuTorch version");
    events.push_back({graph.name, graph.load_bytes(), ms_since(start), program_ms, ms_since(method_start)});
    bytes_loaded += graph.load_bytes();
    set_phase("running");
    return module;
  }

  std::vector<LoadEvent> events;
  int64_t bytes_loaded = 0;

 private:
  Module::LoadMode mode_;
};

// ExecuTorch verifies a program's flatbuffer (InternalConsistency) but not a .ptd data file's: a corrupt one can crash
// the runtime while it loads. So every graph that loads a weights file is first loaded once (by a Loader, as the
// measurement will) in a forked child; a child killed by a signal means a corrupt file, and a child that could not
// load it a bundle that cannot run: either is refused in one line before anything is measured. Run before this
// process loads anything, so the child inherits no thread pool.
inline void probe_weights_files(const Bundle& bundle, const std::string& load_mode) {
  for (const auto& graph : bundle.all) {
    if (!graph.shares_program()) continue;
    set_phase("checking that " + graph.weights.file + " loads");
    pid_t child = fork();
    if (child < 0) throw std::runtime_error("fork failed while checking " + graph.weights.file);
    if (child == 0) {
      // Die of the signal without the runner's one-line crash report: the parent reports.
      for (int fatal : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL}) signal(fatal, SIG_DFL);
      try {
        Loader(load_mode).load(graph);
      } catch (...) {
        _exit(3);
      }
      _exit(0);
    }
    int status = 0;
    while (waitpid(child, &status, 0) < 0) {
    }
    if (WIFSIGNALED(status))
      throw UsageError("graph " + graph.name + ": loading " + graph.program.file + " with " + graph.weights.file +
                       " crashed the ExecuTorch runtime (signal " + std::to_string(WTERMSIG(status)) +
                       "); the weights file is corrupt: re-export the bundle");
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
      throw UsageError("graph " + graph.name + ": ExecuTorch cannot load " + graph.program.file + " with " +
                       graph.weights.file + "; the bundle is corrupt: re-export it");
  }
}

// Run forward on float32 inputs (each buffer exactly its spec's size); copy the float32 outputs out (the module's
// output buffers are reused on the next run), each checked against its spec's size.
inline std::vector<std::vector<float>> run(Module& module, const Graph& graph,
                                           std::vector<std::pair<float*, size_t>> inputs) {
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
    throw std::runtime_error("running " + graph.program.file + " failed " + runtime_error_text(result.error()));
  if (result->size() != graph.outputs.size())
    throw std::runtime_error(graph.program.file + " returned " + std::to_string(result->size()) + " outputs, not " +
                             std::to_string(graph.outputs.size()));
  std::vector<std::vector<float>> outputs;
  for (size_t i = 0; i < result->size(); ++i) {
    const EValue& value = (*result)[i];
    if (!value.isTensor()) throw std::runtime_error(graph.program.file + ": output " + std::to_string(i) + " is not a tensor");
    const auto& tensor = value.toTensor();
    if (tensor.scalar_type() != executorch::aten::ScalarType::Float ||
        static_cast<int64_t>(tensor.numel()) != graph.outputs[i].numel)
      throw std::runtime_error(graph.program.file + ": output " + std::to_string(i) + " (" + graph.outputs[i].name + ") has " +
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
inline void pick_experts(const std::vector<float>& probs, int k, bool renormalize, Inference& out) {
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

// A whole bundle's experts: those that filled token slots for this image in any expert set (expert_tokens (1, G, E)
// summed over the G sets > 0), ascending, each with its share of the image's slots as the gate (export/runtime.py
// Bundle.used_experts). A count that is negative or not finite can only come from a corrupt graph.
inline void used_experts(const std::vector<float>& expert_tokens, int num_experts, Inference& out) {
  if (num_experts < 1 || expert_tokens.size() % static_cast<size_t>(num_experts) != 0)
    throw std::logic_error("expert_tokens holds " + std::to_string(expert_tokens.size()) + " values for " +
                           std::to_string(num_experts) + " experts");
  std::vector<double> counts(static_cast<size_t>(num_experts), 0.0);
  double total = 0;
  for (size_t i = 0; i < expert_tokens.size(); ++i) {
    float count = expert_tokens[i];
    if (!std::isfinite(count) || count < 0)
      throw std::runtime_error("the whole graph reported a negative or non-finite expert token count (a corrupt graph?)");
    counts[i % counts.size()] += count;
    total += count;
  }
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] <= 0) continue;
    out.experts.push_back(static_cast<int>(e));
    out.gates.push_back(static_cast<float>(counts[e] / total));
  }
}

// An output looked up by name (validated to exist when the bundle was read).
inline std::vector<float>& named_output(std::vector<std::vector<float>>& outputs, const Graph& graph,
                                        const char* name) {
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
      if (bundle_.kind == "whole")
        used_experts(named_output(outputs, first, "expert_tokens"), bundle_.num_experts, out);
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
  std::unique_ptr<Module> first_;  // the router, or the one dense / monolithic / whole graph
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
        if (delta.size() != x.size()) throw std::runtime_error(graph.program.file + " returned a delta of the wrong size");
        for (size_t i = 0; i < x.size(); ++i) x[i] += gates.at(j) * delta[i];
      }
    }
    auto outputs = run(*head_, bundle_.head, {{x.data(), x.size()}});
    return named_output(outputs, bundle_.head, "logits");
  }
};

}  // namespace mobile_moe::runner
