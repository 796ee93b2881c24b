/* libmobile_moe: a mobile-moe bundle (manifest.json + ExecuTorch graphs) run inside an app, as the runner runs it.
 *
 *   mm_options options;
 *   mm_default_options(&options);                    // packed weights, parking, 1 thread, top_k experts
 *   mm_model* model = NULL;
 *   if (mm_open("/data/app/bundle", &options, &model) != MM_OK) { log(mm_last_error()); return; }
 *   int classes[5]; float probabilities[5];
 *   mm_result result;
 *   mm_default_result(&result);                      // then point it at the arrays the answer goes into
 *   result.classes = classes, result.probabilities = probabilities, result.top_k = 5;
 *   if (mm_predict_rgb8_into(model, rgb, rgb_bytes, width, height, 3 * width, &result) == MM_OK) {  // or _f32_into
 *     ... mm_class_name(model, classes[0]), result.num_top classes ...
 *   }
 *   mm_close(model);
 *
 * Self-contained: C99 and <stddef.h>/<stdint.h> only; every symbol the library exports is declared here.
 *
 * Failures: every call that can fail returns an mm_status; mm_last_error() is the message of this thread's last
 * failure (one line naming the call, what was wrong and how to fix it). A damaged bundle is refused at mm_open (its
 * manifest, every file's size and sha256 against the manifest, and each ExecuTorch file's structure, checked in this
 * process before anything is loaded), never a crash.
 *
 * A bundle must not change while a handle on it is open: a graph file found changed when an expert is loaded again
 * (another inode, size or modification time than at mm_open) is refused with MM_BAD_BUNDLE, and bytes changed in place
 * while an expert is mapped are undefined. To update a bundle, write the new one into a new folder, open a new
 * handle on it, then close the old handle.
 *
 * Threads: calls on one handle from several threads are serialised (each waits for the one before; never a crash).
 * A prediction's results are the call's own with mm_predict_f32_into and mm_predict_rgb8_into (written into the
 * caller's mm_result under the handle's lock), so threads sharing a handle each get their own answer. mm_logits,
 * mm_top_classes, mm_experts and mm_last_times read the handle's last prediction, whichever thread made it.
 * Two handles run at once. A handle of 1 thread (the default) never uses ExecuTorch's process-wide thread pool: it
 * runs its graphs on the calling thread (and, with prefetch on, loads a missed expert on a thread of its own); handles
 * of more share that pool, which mm_open sizes only while no other handle uses it (a handle that asks for another
 * size then is refused with a message). Graph loads (an open, an expert switch) of two handles take turns: ExecuTorch's
 * XNNPACK backend manages its packed-weight caches process-wide. mm_last_error() is per thread.
 *
 * Process: the library installs no signal handler, never forks or exits, and writes nothing to stdout or stderr: its
 * log, and ExecuTorch's, reaches the callback an app sets with mm_log_set, or nowhere. Its process-wide state: that
 * callback, the thread pool's size above, and ExecuTorch's log, which the first mm_open routes into the library's
 * (ExecuTorch's platform layer is the process's: an app that uses ExecuTorch itself gets its log through the
 * callback too). mm_close(NULL) does nothing; a handle used after mm_close, or closed twice, is refused
 * (MM_BAD_ARGUMENT, or nothing for mm_close) unless a newer handle was given the same address. Strings the library
 * returns (mm_class_name) live as long as their handle.
 *
 * ABI: structs carry their size (mm_default_options, mm_default_result and mm_last_times pass the app's sizeof, and
 * the library reads an app's struct field by whole field), so an app built against this header runs with a later
 * library whose structs grew; MOBILE_MOE_VERSION_MAJOR changes only when that breaks,
 * and it is the library's SOVERSION (libmobile_moe.so.MAJOR).
 */
#ifndef MOBILE_MOE_H
#define MOBILE_MOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MOBILE_MOE_API __attribute__((visibility("default")))
#else
#define MOBILE_MOE_API
#endif

#define MOBILE_MOE_VERSION_MAJOR 2
#define MOBILE_MOE_VERSION_MINOR 2
#define MOBILE_MOE_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH: compare it with mm_version_number() (the library the app runs with) */
#define MOBILE_MOE_VERSION \
  (MOBILE_MOE_VERSION_MAJOR * 10000 + MOBILE_MOE_VERSION_MINOR * 100 + MOBILE_MOE_VERSION_PATCH)

typedef enum mm_status {
  MM_OK = 0,
  MM_BAD_ARGUMENT = 1,  /* a null pointer, a size that does not fit the bundle, an option out of range, a closed handle */
  MM_BAD_BUNDLE = 2,    /* the bundle is missing, damaged, changed since mm_open, or not one this library runs */
  MM_RUNTIME_ERROR = 3, /* ExecuTorch failed to load or run a graph */
  MM_OUT_OF_MEMORY = 4  /* an allocation failed: the handle is as it was before the call */
} mm_status;

typedef struct mm_model mm_model; /* opaque */

/* Each option's range (mobile_moe/library/options.py's table): threads 0..1024, cache_experts and park_experts
 * -1..4096, cache_margin 0..1, weight_cache_limit_mib 1..16777216, prefetch 0 or 1; mm_open refuses a value outside
 * it (MM_BAD_ARGUMENT, naming the field). */
typedef struct mm_options {
  size_t struct_size;        /* sizeof(mm_options) where the app was built: set by mm_default_options */
  int threads;               /* 1: the calling thread alone (default); N > 1: ExecuTorch's shared pool at N threads;
                                0: the shared pool at the size it has */
  int cache_experts;         /* expert graphs kept loaded: -1 (default): the bundle's top_k, the fewest an image needs
                                (the router and one expert in memory); 0: every expert; N: N */
  int park_experts;          /* evicted experts that keep their methods, weights' pages dropped; -1: all (default: each
                                keeps its method's heap, tens of KB on ViT-Ti/32, and a switch back costs half a
                                reload); 0: none (an app that must hold the dense model's peak memory) */
  float cache_margin;        /* cache-aware routing: a loaded expert within this gate margin of the top one. 0 */
  const char* weight_cache_dir; /* XNNPACK's packed weights on disk, one checked file per graph, and the files verified
                                   at open, remembered: NULL (default): the per-user folder (MOBILE_MOE_WEIGHT_CACHE,
                                   else $XDG_CACHE_HOME or ~/.cache, then mobile-moe/packed-weights; off, with a
                                   log line, where none can be used); a path: that folder, created if missing; "":
                                   off. A graph whose file the folder has no room for is packed in memory (log line).
                                   MOBILE_MOE_WEIGHT_CACHE belongs to the default (the environment's, not the app's
                                   choice): unusable, the cache is off with a log line, where the same folder passed
                                   here is refused. mm_model_info's weight_cache_off says why it is off */
  int weight_cache_limit_mib;   /* what that folder may hold, least recently used graphs dropped beyond it. 1024 */
  int prefetch;              /* 1 (default): where the bundle routes early (exported with router_block: a trunk tail
                                after the router), a missed expert loads on a second thread while the tail runs;
                                other bundles load in line (mm_model_info's prefetch says which). 0: always in line */
} mm_options;

typedef struct mm_stage_times {
  size_t struct_size; /* set by mm_last_times */
  double router_ms, expert_ms, load_ms, tail_ms, load_wait_ms, total_ms; /* a bundle of one graph (dense,
                                                   monolithic, whole) runs it all as its router: router_ms = total_ms */
  int cache_hit; /* 1: every chosen expert was loaded already */
} mm_stage_times;

/* One prediction's answer, into memory the caller owns: point the arrays you want at your own (NULL: not wanted),
 * with their room; the call fills the rest. Initialise it with mm_default_result (all NULL, top_k 0). */
typedef struct mm_result {
  size_t struct_size;   /* sizeof(mm_result) where the app was built: set by mm_default_result */
  float* logits;        /* in: room for logits_capacity values, or NULL */
  size_t logits_capacity;
  int* classes;         /* in: room for top_k classes, most probable first (softmax in double; ties: lower index) */
  float* probabilities; /* in: their probabilities, room for top_k, or NULL */
  int top_k;            /* in: the room in classes and probabilities */
  int* experts;         /* in: room for experts_capacity experts, highest gate first, or NULL */
  float* gates;         /* in: their gates, or NULL */
  int experts_capacity;
  int num_classes;      /* out: the bundle's classes (logits written: the fewer of it and logits_capacity) */
  int num_top;          /* out: classes written, min(top_k, num_classes) */
  int num_experts;      /* out: experts the image took (0 for a dense bundle; written: up to experts_capacity) */
  double router_ms, expert_ms, load_ms, tail_ms, load_wait_ms, total_ms; /* out: as mm_stage_times */
  int cache_hit;        /* out: 1 when every chosen expert was loaded already */
} mm_result;

typedef enum mm_log_level { MM_LOG_DEBUG = 0, MM_LOG_INFO = 1, MM_LOG_ERROR = 2 } mm_log_level;
/* One log line (no newline, UTF-8), from any thread the library or ExecuTorch runs: the callback must be
 * thread-safe, and must not call the library's functions on a handle (it may run while that handle's call holds it). */
typedef void (*mm_log_callback)(mm_log_level level, const char* message, void* user_data);

/* "mobile-moe libmobile_moe <major.minor.patch>, executorch-<version>" */
MOBILE_MOE_API const char* mm_version(void);
/* The library's MOBILE_MOE_VERSION: an app built against an older header may run with a newer library. */
MOBILE_MOE_API int mm_version_number(void);

/* The defaults into the first `struct_size` bytes of `options`: an app calls mm_default_options below, a caller
 * through an FFI (ctypes, Dart, JNA), which cannot call a static inline function, calls this with its struct's size. */
MOBILE_MOE_API void mm_options_init(mm_options* options, size_t struct_size);
static inline void mm_default_options(mm_options* options) { mm_options_init(options, sizeof(mm_options)); }

/* This thread's last failure message; "" when none. Valid until this thread's next failing call. */
MOBILE_MOE_API const char* mm_last_error(void);
/* Where the library's log and ExecuTorch's go, for the whole process: NULL (the default) drops them. The library's
 * failures are logged at MM_LOG_ERROR too. */
MOBILE_MOE_API void mm_log_set(mm_log_callback callback, void* user_data);

/* The folder mm_default_options' weight_cache_dir (NULL) means in this process's environment, made if missing; ""
 * where none can be used (packed weights then stay in memory). This thread's string, valid until its next call. */
MOBILE_MOE_API const char* mm_default_weight_cache_dir(void);

/* Open the bundle folder `bundle_dir` with `options` (NULL: the defaults): checks it whole, then loads what is
 * resident from the start (the router, or a dense bundle's one graph). */
MOBILE_MOE_API mm_status mm_open(const char* bundle_dir, const mm_options* options, mm_model** model);
/* After each step mm_prepare has made ready (the open, then each expert's graphs): `done` of `total`. Called on
 * mm_prepare's thread. */
typedef void (*mm_progress_callback)(int done, int total, void* user_data);
/* An app's first launch, done ahead (at install, or on a background thread with progress): the bundle checked whole
 * and remembered as verified, and every graph an image may need packed into the packed-weight folder, so that a later
 * mm_open and first prediction cost what a second launch's do. `options` as mm_open's (their folder is where the work
 * is kept: with packed weights off there is nothing to keep, MM_BAD_ARGUMENT); the bundle's top_k experts are in
 * memory at a time. MM_RUNTIME_ERROR where a graph could not be kept (a full disk: the log says why). `progress` may
 * be NULL. Handles open on the bundle meanwhile are untouched. */
MOBILE_MOE_API mm_status mm_prepare(const char* bundle_dir, const mm_options* options, mm_progress_callback progress,
                                    void* user_data);

/* Waits for a call running on the handle, then frees it. NULL, or a handle closed already: nothing. */
MOBILE_MOE_API void mm_close(mm_model* model);

/* 0 or NULL for a NULL or closed handle */
MOBILE_MOE_API int mm_num_classes(const mm_model* model);
MOBILE_MOE_API const char* mm_class_name(const mm_model* model, int index); /* NULL outside 0..classes-1 */
MOBILE_MOE_API int mm_input_channels(const mm_model* model);
MOBILE_MOE_API int mm_input_size(const mm_model* model); /* S: inputs are C x S x S */

/* One image, already resized and normalised as the bundle's manifest says (its input.resize, mean and std):
 * `count` = C * S * S float32 values, channel-major. */
MOBILE_MOE_API mm_status mm_predict_f32(mm_model* model, const float* chw, size_t count);

/* One image as an app has it: 8-bit RGB in a buffer of `length` bytes, `width` x `height` pixels of 3 bytes,
 * `row_stride` bytes from one row to the next (>= 3 * width; the last row needs only 3 * width of them, so
 * (height - 1) * row_stride + 3 * width <= length). Resized and normalised as the bundle's manifest says
 * (input.resize, mean, std): the values mobile_moe/preprocess.py gives the same image read from a file, byte for
 * byte (Pillow's resampling). A grey bundle takes Pillow's RGB -> L. Sides up to 32768. */
MOBILE_MOE_API mm_status mm_predict_rgb8(mm_model* model, const uint8_t* rgb, size_t length, int width, int height,
                                         int row_stride);
/* The same preprocessing alone, into `chw` (capacity C * S * S values), for an app that runs it elsewhere. */
MOBILE_MOE_API mm_status mm_preprocess_rgb8(const mm_model* model, const uint8_t* rgb, size_t length, int width,
                                            int height, int row_stride, float* chw, size_t capacity);

/* mm_predict_f32 and mm_predict_rgb8 with the answer written into `result` (the caller's: see mm_result) while the
 * handle is held: the call's own answer, whichever thread shares the handle. A result whose struct_size is unset, or
 * whose array pointer is NULL with room given, is refused (MM_BAD_ARGUMENT) before anything runs. */
MOBILE_MOE_API mm_status mm_predict_f32_into(mm_model* model, const float* chw, size_t count, mm_result* result);
MOBILE_MOE_API mm_status mm_predict_rgb8_into(mm_model* model, const uint8_t* rgb, size_t length, int width,
                                              int height, int row_stride, mm_result* result);
/* A result with nothing asked, into the first `struct_size` bytes (an app calls mm_default_result below). */
MOBILE_MOE_API void mm_result_init(mm_result* result, size_t struct_size);
static inline void mm_default_result(mm_result* result) { mm_result_init(result, sizeof(mm_result)); }

/* The handle's last prediction, whichever thread made it (each 0 / nothing before the first): */
MOBILE_MOE_API size_t mm_logits(const mm_model* model, float* logits, size_t capacity); /* -> classes; copies */
/* The k most probable classes (softmax of the logits, computed in double), most probable first; -> how many were
 * written: min(k, classes), 0 for k <= 0 */
MOBILE_MOE_API int mm_top_classes(const mm_model* model, int k, int* classes, float* probabilities);
/* The experts the image took, highest gate first, and their gates (at most `capacity` copied; either array may be
 * NULL); -> how many it took (0 for a dense bundle): call with capacity 0 to size the arrays */
MOBILE_MOE_API int mm_experts(const mm_model* model, int capacity, int* experts, float* gates);
/* The stage times into the first `struct_size` bytes of `times` (an app calls mm_last_times below). */
MOBILE_MOE_API void mm_stage_times_get(const mm_model* model, mm_stage_times* times, size_t struct_size);
static inline void mm_last_times(const mm_model* model, mm_stage_times* times) {
  mm_stage_times_get(model, times, sizeof(mm_stage_times));
}

#ifdef __cplusplus
}
#endif

#endif /* MOBILE_MOE_H */
