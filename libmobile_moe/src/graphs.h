// The ExecuTorch side of libmobile_moe, over graph_loader.h's loads: run a graph, keep an LRU of
// expert graphs, and the pipeline that takes one image through router -> top-k experts -> logits for every layout
// (or through the one graph of a dense, monolithic or whole bundle).
#pragma once

#include <algorithm>
#include <cstddef>
#include <exception>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "graph_loader.h"
#include "process_mappings.h"

namespace mobile_moe::library {

struct Bundle;
struct Graph;

// Run forward on float32 inputs (each buffer exactly its spec's size); copy the float32 outputs out (the method's
// output buffers are reused on the next run), each checked against its spec's size.
std::vector<std::vector<float>> run(LoadedGraph& loaded, const Graph& graph,
                                    std::vector<std::pair<float*, size_t>> inputs);

// An expert's loaded graphs: one, or one per MoE block.
using ExpertGraphs = std::vector<std::unique_ptr<LoadedGraph>>;

class ExpertCache {
 public:
  // `capacity`: experts resident at once. `park`: how many experts evicted beyond it are parked rather than unloaded
  // (-1: every one): a parked expert keeps its initialised method but none of its weights' pages
  // (LoadedGraph::park_weights), so switching back to it skips the load (method init was most of a switch: XNNPACK
  // builds the expert's runtimes, backends/xnnpack/runtime/XNNCompiler.cpp compileModel) and pays only for faulting
  // its packed weights back in. What a parked expert holds: its method's heap, about 30 KB on ViT-Ti/32
  // (benchmarks/expert_switch_vit_ti32.results.md); its planned memory is the shared arena (PlannedArenas).
  ExpertCache(const Bundle& bundle, Loader& loader, int capacity, int park)
      : bundle_(bundle), loader_(loader), capacity_(capacity), park_(park) {}

  // The expert's graphs: resident (a hit), parked (made resident again), or loaded, after evicting the least recently
  // used expert beyond capacity. `scratch`: load it from an empty packed-weight cache (Loader::load), to measure a cold
  // switch, even when it is parked.
  ExpertGraphs& get(int expert, bool* hit, double* load_ms, bool scratch = false);

  // Prefetch (prefetches()): while the caller runs the trunk tail, a second thread releases the experts evicted to
  // make room, then loads `expert` and brings its mapped packed weights in (Loader::load's warm_weights), so the first
  // run reads them from the cache, not through page faults; finish() joins the thread and caches the expert. Releasing
  // first keeps one expert in memory at a time (max_resident()); releasing after the load, while the caller runs the
  // expert, measured no faster on ViT-Ti/32 and held two. Evicted experts that park do so on the caller's thread
  // (dropping pages is quick). The thread writes into `prefetch` until it is joined.
  struct Prefetch {
    int expert = -1;
    std::thread thread;
    ExpertGraphs graphs;
    double load_ms = 0;
    std::exception_ptr error;

    ~Prefetch();
  };
  void load_on_thread(int expert, Prefetch& prefetch);
  // -> ms the caller waited for the load after its own work.
  double finish(Prefetch& prefetch);

  // Evict a resident expert: park it where it can park, else unload it.
  void unload(int expert);

  std::set<int> resident() const { return std::set<int>(order_.begin(), order_.end()); }
  bool parked(int expert) const { return parked_.count(expert) > 0; }
  int max_resident() const { return max_resident_; }

  // The loaded experts, most recently used first.
  std::vector<int> loaded_experts() const { return std::vector<int>(order_.begin(), order_.end()); }

  // The parked experts, and the mappings of their packed weights (all dropped when they parked).
  std::vector<int> parked_experts() const;
  std::vector<stats::Mapping> parked_mappings() const;

 private:
  const Bundle& bundle_;
  Loader& loader_;
  int capacity_;
  int park_;
  std::map<int, ExpertGraphs> graphs_;
  std::list<int> order_;     // most recently used first
  std::set<int> scratch_;    // experts loaded from a scratch cache file
  std::map<int, ExpertGraphs> parked_;
  std::list<int> parked_order_;  // most recently parked first
  // Experts resident (loaded, not parked), and the most at any moment. A prefetching thread updates them before it
  // is joined, while the caller runs only the trunk tail.
  int live_ = 0, max_resident_ = 0;

  ExpertGraphs& insert(int expert, ExpertGraphs graphs);
  // A resident expert out of the resident set: parked when every graph of it can park (LoadedGraph::parkable: a
  // scratch load's cannot) and parking is on, the least recently parked expert beyond `park_` unloaded; -> its graphs
  // when it did not park (empty when it did), for the caller to release. `scratch`: they came from a scratch file.
  ExpertGraphs evict(int expert, bool* scratch);
  // A parked expert's graphs, no longer parked; empty when it is not parked.
  ExpertGraphs unpark(int expert);
  void release(ExpertGraphs graphs, bool scratch);
  void note_loaded() { max_resident_ = std::max(max_resident_, ++live_); }
  void released(size_t experts) { live_ -= static_cast<int>(experts); }
};

// ---------------------------------------------------------------------------------------------------------------
// The pipeline: one image end to end

struct Inference {
  std::vector<float> logits;
  std::vector<int> experts;
  std::vector<float> gates;
  double router_ms = 0, expert_ms = 0, load_ms = 0, total_ms = 0;
  double tail_ms = 0;       // early routing: the trunk's last dense blocks, run while the expert loads
  double load_wait_ms = 0;  // prefetches(): how long the image waited for the loading thread after its own work
  bool hit = true;
};

// Whether a chosen expert that is not loaded loads on a second thread while the image computes what does not need it
// yet: early routing's trunk tail (expert-paths, k = 1). The per-block layout could load each block's expert graph
// while the blocks before it run; measured on ViT-Ti/32 (benchmarks/expert_switch_vit_ti32.results.md) it was slower
// than loading in line, at 1 thread and at 2, so it does not.
bool prefetches(const Bundle& bundle);

class Pipeline {
 public:
  // `prefetch`: load a missed expert on a second thread where the bundle allows it (prefetches()); false: in line.
  Pipeline(const Bundle& bundle, Loader& loader, int cache_experts, int park_experts, float cache_margin,
           bool prefetch)
      : bundle_(bundle),
        loader_(loader),
        cache_(bundle, loader, cache_experts, park_experts),
        cache_margin_(cache_margin),
        prefetch_(prefetch && prefetches(bundle)) {}

  // Everything loaded at open: the router (+ per-block shared parts and head), or the single graph.
  double load_resident();

  Inference infer(std::vector<float>& image);

  // The tokens an expert takes for one image (after the trunk tail, with early routing).
  std::vector<float> route(std::vector<float>& image);

  // One chosen expert's computation on given tokens: what an expert switch has to wait for after loading.
  std::vector<float> run_expert(int expert, ExpertGraphs& graphs, std::vector<float> tokens);

  ExpertCache& cache() { return cache_; }

 private:
  const Bundle& bundle_;
  Loader& loader_;
  std::unique_ptr<LoadedGraph> first_;  // the router, or the one dense / monolithic / whole graph
  std::vector<std::unique_ptr<LoadedGraph>> shared_;  // per-block: each MoE block's attention half
  std::unique_ptr<LoadedGraph> head_;                  // per-block: final norm + classifier
  std::unique_ptr<LoadedGraph> tail_;                  // early routing: the dense blocks after the router
  ExpertCache cache_;
  float cache_margin_;  // cache-aware routing (pick_experts); 0: plain top-k
  bool prefetch_;

  // The chosen expert (k = 1), when not loaded, loads on a second thread while this one does `work` (the trunk tail);
  // the image then waits only for what the work did not cover (load_wait_ms).
  template <typename Work>
  auto while_prefetching(Inference& out, Work work) -> decltype(work());

  std::vector<float> run_tail(std::vector<float>& tokens);

  std::vector<float> run_path(LoadedGraph& loaded, int expert, std::vector<float>& tokens, float gate);

  // x = tokens; per block: residual, normed = shared(x); x = residual + sum_j gate_j * expert_j(normed); head(x).
  std::vector<float> run_blocks(std::vector<float> x, const std::vector<int>& experts,
                                std::vector<ExpertGraphs*>& chosen, const std::vector<float>& gates);
};

}  // namespace mobile_moe::library
