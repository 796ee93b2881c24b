// graphs.h: graphs run, the expert cache, and the pipeline that takes one image through them.
#include "graphs.h"

#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/core/error.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bundle_manifest.h"
#include "bundle_routing.h"
#include "errors.h"
#include "graph_loader.h"
#include "runtime_log.h"

namespace mobile_moe::library {

using executorch::runtime::EValue;

std::vector<std::vector<float>> run(LoadedGraph& loaded, const Graph& graph,
                                    std::vector<std::pair<float*, size_t>> inputs) {
  if (inputs.size() != graph.inputs.size())
    throw std::logic_error("graph " + graph.name + " fed " + std::to_string(inputs.size()) + " inputs");
  auto& method = loaded.method();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (static_cast<int64_t>(inputs[i].second) != graph.inputs[i].numel)
      throw std::runtime_error("graph " + graph.name + ": input " + std::to_string(i) + " has " +
                               std::to_string(inputs[i].second) + " values, not " +
                               std::to_string(graph.inputs[i].numel));
    auto tensor = executorch::extension::from_blob(inputs[i].first, graph.inputs[i].shape);
    auto status = method.set_input(EValue(*tensor), i);  // copied into the method's planned input buffer
    if (status != executorch::runtime::Error::Ok)
      throw std::runtime_error("feeding " + graph.program.file + " input " + std::to_string(i) + " failed " +
                               runtime_error_text(status));
  }
  auto status = method.execute();
  if (status != executorch::runtime::Error::Ok)
    throw std::runtime_error("running " + graph.program.file + " failed " + runtime_error_text(status));
  if (method.outputs_size() != graph.outputs.size())
    throw std::runtime_error(graph.program.file + " returned " + std::to_string(method.outputs_size()) +
                             " outputs, not " + std::to_string(graph.outputs.size()));
  std::vector<std::vector<float>> outputs;
  for (size_t i = 0; i < method.outputs_size(); ++i) {
    const EValue& value = method.get_output(i);
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

ExpertCache::Prefetch::~Prefetch() {
  if (thread.joinable()) thread.join();  // the caller failed before finish(): the thread still writes here
}

ExpertGraphs& ExpertCache::get(int expert, bool* hit, double* load_ms, bool scratch) {
  auto found = graphs_.find(expert);
  *hit = found != graphs_.end();
  *load_ms = 0.0;
  if (*hit) {
    order_.remove(expert);
    order_.push_front(expert);
    return found->second;
  }
  auto start = Clock::now();
  // Unparked before the eviction, which may trim the parked set.
  ExpertGraphs graphs = scratch ? ExpertGraphs{} : unpark(expert);
  while (static_cast<int>(graphs_.size()) >= capacity_) unload(order_.back());
  if (graphs.empty()) {
    for (const auto& graph : bundle_.experts[expert]) graphs.push_back(loader_.load(graph, scratch));
    if (scratch) scratch_.insert(expert);
  }
  note_loaded();
  *load_ms = ms_since(start);
  return insert(expert, std::move(graphs));
}

void ExpertCache::load_on_thread(int expert, Prefetch& prefetch) {
  std::vector<ExpertGraphs> leaving;
  while (static_cast<int>(graphs_.size()) >= capacity_) {
    bool scratch = false;  // serving never loads from a scratch cache file
    leaving.push_back(evict(order_.back(), &scratch));
  }
  prefetch.expert = expert;
  prefetch.thread = std::thread([this, expert, &prefetch, leaving = std::move(leaving)]() mutable {
    try {
      leaving.clear();  // first: one expert in memory at a time (measured: no slower than releasing it after)
      auto start = Clock::now();
      for (const auto& graph : bundle_.experts[expert])
        prefetch.graphs.push_back(loader_.load(graph, false, /*warm_weights=*/true));
      note_loaded();
      prefetch.load_ms = ms_since(start);
    } catch (...) {
      prefetch.error = std::current_exception();
    }
  });
}

double ExpertCache::finish(Prefetch& prefetch) {
  auto start = Clock::now();
  prefetch.thread.join();
  double waited = ms_since(start);
  if (prefetch.error) std::rethrow_exception(prefetch.error);
  insert(prefetch.expert, std::move(prefetch.graphs));
  return waited;
}

void ExpertCache::unload(int expert) {
  if (!graphs_.count(expert)) return;
  bool scratch = false;
  ExpertGraphs graphs = evict(expert, &scratch);
  release(std::move(graphs), scratch);
}

std::vector<int> ExpertCache::parked_experts() const {
  std::vector<int> experts;
  for (const auto& [expert, graphs] : parked_) experts.push_back(expert);
  return experts;
}

std::vector<stats::Mapping> ExpertCache::parked_mappings() const {
  std::vector<stats::Mapping> mappings;
  for (const auto& [expert, graphs] : parked_)
    for (const auto& graph : graphs)
      mappings.insert(mappings.end(), graph->packed_mappings().begin(), graph->packed_mappings().end());
  return mappings;
}

ExpertGraphs& ExpertCache::insert(int expert, ExpertGraphs graphs) {
  auto& slot = graphs_[expert] = std::move(graphs);
  order_.push_front(expert);
  return slot;
}

ExpertGraphs ExpertCache::evict(int expert, bool* scratch) {
  *scratch = scratch_.erase(expert) > 0;
  ExpertGraphs graphs = std::move(graphs_.at(expert));
  graphs_.erase(expert);
  order_.remove(expert);
  released(1);
  auto parkable = [](const auto& graph) { return graph->parkable(); };
  if (park_ == 0 || !std::all_of(graphs.begin(), graphs.end(), parkable)) return graphs;
  for (const auto& graph : graphs) graph->park_weights();
  parked_[expert] = std::move(graphs);
  parked_order_.push_front(expert);
  while (park_ >= 0 && static_cast<int>(parked_.size()) > park_) release(unpark(parked_order_.back()), false);
  return {};
}

ExpertGraphs ExpertCache::unpark(int expert) {
  auto found = parked_.find(expert);
  if (found == parked_.end()) return {};
  ExpertGraphs graphs = std::move(found->second);
  parked_.erase(found);
  parked_order_.remove(expert);
  return graphs;
}

void ExpertCache::release(ExpertGraphs graphs, bool scratch) {
  for (auto& graph : graphs) loader_.unload(std::move(graph), scratch);
}

// The experts an image took (bundle_routing.h), and their gates, into its Inference.
static void record_choice(RoutedExperts&& choice, Inference& out) {
  out.experts = std::move(choice.experts);
  out.gates = std::move(choice.gates);
}

// An output looked up by name (validated to exist when the bundle was read).
static std::vector<float>& named_output(std::vector<std::vector<float>>& outputs, const Graph& graph,
                                        const char* name) {
  int index = graph.output(name);
  if (index < 0 || static_cast<size_t>(index) >= outputs.size())
    throw std::logic_error("graph " + graph.name + " has no output " + name);
  return outputs[index];
}

bool prefetches(const Bundle& bundle) {
  return bundle.kind == Kind::Split && bundle.top_k == 1 && !bundle.trunk_tail.name.empty();
}

double Pipeline::load_resident() {
  auto start = Clock::now();
  first_ = loader_.load(bundle_.first());
  for (const auto& graph : bundle_.shared) shared_.push_back(loader_.load(graph));
  if (bundle_.layout == Layout::PerBlock) head_ = loader_.load(bundle_.head);
  if (!bundle_.trunk_tail.name.empty()) tail_ = loader_.load(bundle_.trunk_tail);
  return ms_since(start);
}

Inference Pipeline::infer(std::vector<float>& image) {
  Inference out;
  auto start = Clock::now();
  const Graph& first = bundle_.first();
  auto outputs = run(*first_, first, {{image.data(), image.size()}});
  if (bundle_.kind != Kind::Split) {
    out.logits = named_output(outputs, first, "logits");
    if (bundle_.kind == Kind::Monolithic)
      record_choice(pick_experts(named_output(outputs, first, "router_probs"), bundle_.top_k,
                                 bundle_.renormalize_gates, /*resident=*/{}, /*margin=*/0.0f),
                    out);
    if (bundle_.kind == Kind::Whole)
      record_choice(used_experts(named_output(outputs, first, "expert_tokens"), bundle_.num_experts), out);
    out.total_ms = out.router_ms = ms_since(start);
    return out;
  }
  std::vector<float> tokens = std::move(named_output(outputs, first, "tokens"));
  record_choice(pick_experts(named_output(outputs, first, "router_probs"), bundle_.top_k, bundle_.renormalize_gates,
                             cache_.resident(), cache_margin_),
                out);
  out.router_ms = ms_since(start);
  if (tail_) {
    auto tail_start = Clock::now();
    tokens = prefetch_ ? while_prefetching(out, [&] { return run_tail(tokens); }) : run_tail(tokens);
    out.tail_ms = ms_since(tail_start) - out.load_wait_ms;
  }
  auto expert_start = Clock::now();
  std::vector<ExpertGraphs*> chosen;
  for (int expert : out.experts) {
    bool hit = false;
    double load_ms = 0;
    chosen.push_back(&cache_.get(expert, &hit, &load_ms));  // a hit after a prefetch
    out.hit = out.hit && hit;
    out.load_ms += load_ms;
    out.expert_ms -= load_ms;  // expert_ms is the experts' computation
  }
  out.logits = bundle_.layout == Layout::PerBlock ? run_blocks(tokens, out.experts, chosen, out.gates)
                                                  : run_path(*chosen[0]->at(0), out.experts[0], tokens, out.gates[0]);
  out.expert_ms += ms_since(expert_start);
  out.total_ms = ms_since(start);
  return out;
}

std::vector<float> Pipeline::route(std::vector<float>& image) {
  auto outputs = run(*first_, bundle_.router, {{image.data(), image.size()}});
  std::vector<float> tokens = std::move(named_output(outputs, bundle_.router, "tokens"));
  return tail_ ? run_tail(tokens) : tokens;
}

std::vector<float> Pipeline::run_expert(int expert, ExpertGraphs& graphs, std::vector<float> tokens) {
  std::vector<ExpertGraphs*> chosen{&graphs};
  return bundle_.layout == Layout::PerBlock ? run_blocks(tokens, {expert}, chosen, {1.0f})
                                            : run_path(*graphs[0], expert, tokens, 1.0f);
}

template <typename Work>
auto Pipeline::while_prefetching(Inference& out, Work work) -> decltype(work()) {
  const int expert = out.experts.at(0);
  if (cache_.resident().count(expert) || cache_.parked(expert)) return work();  // nothing to load
  ExpertCache::Prefetch prefetch;
  cache_.load_on_thread(expert, prefetch);
  auto result = work();
  out.load_wait_ms = cache_.finish(prefetch);
  out.load_ms = prefetch.load_ms;
  out.hit = false;
  return result;
}

std::vector<float> Pipeline::run_tail(std::vector<float>& tokens) {
  auto outputs = run(*tail_, bundle_.trunk_tail, {{tokens.data(), tokens.size()}});
  return std::move(named_output(outputs, bundle_.trunk_tail, "tokens"));
}

std::vector<float> Pipeline::run_path(LoadedGraph& loaded, int expert, std::vector<float>& tokens, float gate) {
  const Graph& graph = bundle_.experts.at(expert).at(0);
  auto outputs = run(loaded, graph, {{tokens.data(), tokens.size()}, {&gate, 1}});
  return named_output(outputs, graph, "logits");
}

std::vector<float> Pipeline::run_blocks(std::vector<float> x, const std::vector<int>& experts,
                                        std::vector<ExpertGraphs*>& chosen, const std::vector<float>& gates) {
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

}  // namespace mobile_moe::library
