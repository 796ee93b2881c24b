/* libmobile_moe's measurement interface: what a benchmark needs beyond mobile_moe.h, for any app that wants it too.
 * The native runner (bench's tool) is its client: it times expert switches and graph loads with these calls alone.
 *
 *   mm_model_info info;
 *   mm_get_model_info(model, &info);                 // the bundle, and the options as mm_open resolved them
 *   mm_route_f32(model, chw, count);                 // the router alone: an image's tokens, kept for mm_expert_run
 *   mm_expert_load(model, 2, 0, NULL);               // a switch from expert 2 to expert 3, step by step:
 *   int64_t first = mm_load_count(model);            //   (with one expert cached, loading 3 evicts 2 anyway)
 *   mm_expert_unload(model, 2);                      //   the expert it leaves, parked or unloaded
 *   mm_expert_load(model, 3, 0, &load_ms);           //   its graphs loaded, or unparked (no graph load then)
 *   mm_expert_run(model, 3, &run_ms);                //   its first run on those tokens
 *   for (int64_t i = first; i < mm_load_count(model); ++i) mm_get_load_event(model, i, &event);  // each load
 *
 * The router takes floats, as mm_predict_f32 does: an app's pixels go through mm_preprocess_rgb8 first. Routing and
 * unloading return no time of their own: an app times the call (they do nothing else).
 *
 * What a switch costs depends on where the expert was: loaded (mm_expert_load does nothing), parked (it only comes
 * back: no load event, a fraction of a millisecond), or neither (its graphs load from the packed-weight folder, or
 * pack). mm_expert_unload parks an expert only where parking is on (mm_options.park_experts) and its last load
 * mapped its weights from a warm packed-weight file (a load that packed them unloads when evicted, and parks after
 * its next load); mm_parked_experts says which are parked. To time loads alone, open with park_experts = 0; for the
 * first load on a device, MM_LOAD_COLD.
 *
 * The rules are mobile_moe.h's: calls on one handle serialise, failures return a status with mm_last_error() naming
 * the call (a success leaves it as it was). Structs carry their size: mm_load_settings, which the app fills, starts
 * from mm_default_load_settings; the structs the library fills (mm_model_info, mm_memory_stats, mm_load_event) are
 * read through the inline mm_get_* calls, which pass the app's sizeof. Strings the library returns live as long as
 * their handle. The expert calls are for split bundles (a router and one graph set per expert); on another bundle
 * they fail with MM_BAD_ARGUMENT.
 */
#ifndef MOBILE_MOE_MEASURE_H
#define MOBILE_MOE_MEASURE_H

#include "mobile_moe.h" /* these calls came with MOBILE_MOE_VERSION 20100 (2.1.0): mm_version_number() says */

#ifdef __cplusplus
extern "C" {
#endif

/* How graphs are loaded, beyond mm_options: what a benchmark varies. */
typedef struct mm_load_settings {
  size_t struct_size;    /* set by mm_default_load_settings */
  int read_files;        /* 0 (default): graph files are mapped; 1: read into memory (ExecuTorch's FileDataLoader) */
  int workspace_sharing; /* XNNPACK's workspace sharing for every load: -1 (default) its own default, 0 none,
                            1 per model, 2 global (backends/xnnpack/runtime/XNNWorkspaceManager.h) */
  int kept_loads;        /* graph loads whose events mm_get_load_event reads: the last 64 (default: an app that
                            switches experts for days holds a bounded record), the last N (0: none), or -1: every one
                            (a benchmark); below -1 is refused */
} mm_load_settings;

MOBILE_MOE_API void mm_load_settings_init(mm_load_settings* settings, size_t struct_size);
static inline void mm_default_load_settings(mm_load_settings* settings) {
  mm_load_settings_init(settings, sizeof(mm_load_settings));
}
/* mm_open with `load` (NULL: the defaults, which are mm_open's). */
MOBILE_MOE_API mm_status mm_open_with(const char* bundle_dir, const mm_options* options,
                                      const mm_load_settings* load, mm_model** model);

/* What a runtime does with a bundle (the manifest's kind): a router and experts loaded one by one, or one graph. */
typedef enum mm_bundle_kind {
  MM_BUNDLE_SPLIT = 0,      /* "split": the router, then the chosen experts' graphs */
  MM_BUNDLE_DENSE = 1,      /* "dense": one graph, no experts */
  MM_BUNDLE_MONOLITHIC = 2, /* "monolithic": one graph with its router and every expert inside */
  MM_BUNDLE_WHOLE = 3       /* "whole": one graph of a per-token MoE */
} mm_bundle_kind;

/* The bundle, and the options as mm_open resolved them. Strings live as long as the handle. */
typedef struct mm_model_info {
  size_t struct_size;           /* set by mm_get_model_info */
  const char* bundle_dir;       /* the bundle's real path */
  int kind;                     /* mm_bundle_kind */
  const char* kind_name;        /* the manifest's word for it: "split", "dense", "monolithic" or "whole" */
  const char* layout;           /* its composition.layout ("dense", "monolithic", "expert-paths", "per-block", ...) */
  const char* weight_cache_dir; /* the packed weights' folder; "" when off */
  int threads;                  /* 1, or the shared pool's size the handle runs on */
  int num_experts;              /* the manifest's experts (0: none) */
  int top_k;                    /* experts an image takes */
  int cache_experts;            /* expert graph sets kept loaded, as resolved; 0: a one-graph bundle */
  int prefetch;                 /* 1: a missed expert loads on a second thread while the trunk tail runs */
  int has_trunk_tail;           /* 1: early routing, dense blocks between the router and the expert */
  int graphs;                   /* graphs the manifest lists: mm_graph's indices */
  double resident_load_ms;      /* mm_open's load of the router (and what stays with it), or of the single graph */
  const char* weight_cache_off; /* why packed weights are off ("" when on; the log said it too). Since 2.2.0 */
} mm_model_info;

MOBILE_MOE_API mm_status mm_model_info_get(const mm_model* model, mm_model_info* info, size_t struct_size);
static inline mm_status mm_get_model_info(const mm_model* model, mm_model_info* info) {
  return mm_model_info_get(model, info, sizeof(mm_model_info));
}

/* Graph `index` of the manifest (0 .. info.graphs - 1): its name, and the bytes loading it reads (program and
 * weights file); either pointer may be NULL. */
MOBILE_MOE_API mm_status mm_graph(const mm_model* model, int index, const char** name, int64_t* load_bytes);

/* What the handle holds and has loaded so far. */
typedef struct mm_memory_stats {
  size_t struct_size;            /* set by mm_get_memory_stats */
  int64_t graph_bytes_loaded;    /* by every graph load since mm_open */
  int max_experts_resident;      /* the most expert graph sets loaded (not parked) at one moment */
  int64_t planned_memory_bytes;  /* the planned-memory arena the graphs share */
  int64_t weight_cache_bytes;    /* what the packed weights' folder holds (0 when off) */
  int64_t parked_bytes_resident; /* of the parked experts' packed weights, resident now; -1 where the OS cannot say */
} mm_memory_stats;

MOBILE_MOE_API mm_status mm_memory_stats_get(const mm_model* model, mm_memory_stats* stats, size_t struct_size);
static inline mm_status mm_get_memory_stats(const mm_model* model, mm_memory_stats* stats) {
  return mm_memory_stats_get(model, stats, sizeof(mm_memory_stats));
}

/* Graph loads since mm_open, in order (an expert unparked is not a load): an index is a load's for the handle's
 * life; the last kept_loads of them (mm_load_settings) can be read, an earlier one is refused. 0 for a closed
 * handle. */
MOBILE_MOE_API int64_t mm_load_count(const mm_model* model);

/* One graph load and its parts. The strings live as long as the handle. */
typedef struct mm_load_event {
  size_t struct_size; /* set by mm_get_load_event */
  const char* graph;  /* the manifest's name of the graph */
  int64_t bytes;      /* what loading it read */
  double ms;          /* the whole load */
  double program_ms, data_map_ms, cache_check_ms, method_ms, cache_record_ms; /* its parts */
  double bring_in_ms; /* prefetching: reading the mapped packed weights in, on the loading thread */
  const char* cache;   /* the packed weights' file: "off", "cold" (packed, then written) or "warm" (found) */
  const char* weights; /* "packed" (in this process's memory) or "mapped" (from the packed weights' file) */
} mm_load_event;

MOBILE_MOE_API mm_status mm_load_event_get(const mm_model* model, int64_t index, mm_load_event* event,
                                           size_t struct_size);
static inline mm_status mm_get_load_event(const mm_model* model, int64_t index, mm_load_event* event) {
  return mm_load_event_get(model, index, event, sizeof(mm_load_event));
}

/* The graphs of the experts loaded now, least recently used last, at most `capacity` names (they live as long as
 * the handle); -> how many there are. */
MOBILE_MOE_API int mm_loaded_graphs(const mm_model* model, int capacity, const char** names);
/* The parked experts (evicted, their methods kept, their weights' pages dropped), at most `capacity`; -> how many. */
MOBILE_MOE_API int mm_parked_experts(const mm_model* model, int capacity, int* experts);

/* Expert `expert` evicted: parked where parking is on (mm_options.park_experts), else unloaded. Nothing if it is not
 * loaded. */
MOBILE_MOE_API mm_status mm_expert_unload(mm_model* model, int expert);
/* Load `expert` (unpark it, or load its graphs, evicting the least recently used beyond cache_experts); `load_ms`
 * (may be NULL): the time that took, 0 when it was loaded already. MM_LOAD_COLD: from an empty packed-weight file of
 * its own (what the first load on a device pays), removed when the expert is next unloaded. */
#define MM_LOAD_COLD 1
MOBILE_MOE_API mm_status mm_expert_load(mm_model* model, int expert, int flags, double* load_ms);
/* The router (and trunk tail) alone on one image, as mm_predict_f32 takes it: its tokens are kept for
 * mm_expert_run. It chooses no expert and changes no result of mobile_moe.h (mm_experts, mm_logits are the last
 * prediction's): the expert an image takes is what mm_predict_f32 and mm_experts say. */
MOBILE_MOE_API mm_status mm_route_f32(mm_model* model, const float* chw, size_t count);
/* Loaded expert `expert` on the tokens of the last mm_route_f32; `ms` (may be NULL): the time it took. Its output is
 * not kept: this times the expert, it predicts nothing. */
MOBILE_MOE_API mm_status mm_expert_run(mm_model* model, int expert, double* ms);

#ifdef __cplusplus
}
#endif

#endif /* MOBILE_MOE_MEASURE_H */
