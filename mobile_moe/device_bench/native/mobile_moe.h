/* libmobile_moe: a mobile-moe bundle (manifest.json + ExecuTorch graphs) run inside an app, as the runner runs it.
 *
 *   mm_options options;
 *   mm_default_options(&options);
 *   options.cache_experts = 1;                       // one expert in memory: the router and the chosen expert
 *   mm_model* model = NULL;
 *   if (mm_open("/data/app/bundle", &options, &model) != MM_OK) { log(mm_last_error()); return; }
 *   if (mm_predict_f32(model, chw, 3 * 224 * 224) == MM_OK) {   // pre-normalised float32, C x S x S
 *     int classes[5]; float probabilities[5];
 *     int n = mm_top_classes(model, 5, classes, probabilities);
 *     ... mm_class_name(model, classes[0]) ...
 *   }
 *   mm_close(model);
 *
 * Self-contained: C99 and <stddef.h>/<stdint.h> only; every symbol the library exports is declared here.
 *
 * Failures: every call that can fail returns an mm_status; mm_last_error() is the message of this thread's last
 * failure (one line naming what was wrong and how to fix it, the native runner's words for the same bundle). A
 * damaged bundle is refused at mm_open (its manifest, every file's size and sha256 against the manifest, and each
 * ExecuTorch file's structure, checked in this process before anything is loaded), never a crash.
 *
 * Threads: a model handle is not thread-safe: calls on one handle must not overlap (an app serialises them, or opens
 * one handle per thread). Two handles may be used from two threads at once; they share ExecuTorch's process-wide
 * thread pool, whose size mm_open sets (options.threads) for every handle. mm_last_error() is per thread. The library
 * never forks, installs signal handlers or exits.
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

typedef enum mm_status {
  MM_OK = 0,
  MM_BAD_ARGUMENT = 1,  /* a null pointer, a size that does not fit the bundle, an option out of range */
  MM_BAD_BUNDLE = 2,    /* the bundle is missing, damaged or not one this library runs */
  MM_RUNTIME_ERROR = 3, /* ExecuTorch failed to load or run a graph */
  MM_OUT_OF_MEMORY = 4
} mm_status;

typedef struct mm_model mm_model; /* opaque */

typedef struct mm_options {
  int threads;               /* ExecuTorch's thread pool (process-wide); 0: leave it as it is. Default 1 */
  int cache_experts;         /* expert graphs kept loaded; 0: every expert. Default 0 */
  int park_experts;          /* evicted experts that keep their methods, weights' pages dropped; -1: all; 0: none */
  float cache_margin;        /* cache-aware routing: a loaded expert within this gate margin of the top one. 0 */
  const char* weight_cache_dir; /* XNNPACK's packed weights on disk, one checked file per graph; NULL: off */
  int weight_cache_limit_mib;   /* what that folder may hold */
  int prefetch;              /* 1: a missed expert loads on a second thread while early routing's trunk tail runs */
} mm_options;

typedef struct mm_stage_times {
  double router_ms, expert_ms, load_ms, tail_ms, load_wait_ms, total_ms;
  int cache_hit; /* 1: every chosen expert was loaded already */
} mm_stage_times;

/* "mobile-moe <version>, executorch <version>" */
MOBILE_MOE_API const char* mm_version(void);
MOBILE_MOE_API void mm_default_options(mm_options* options);
/* This thread's last failure message; "" when none. Valid until this thread's next failing call. */
MOBILE_MOE_API const char* mm_last_error(void);

/* Open the bundle folder `bundle_dir` with `options` (NULL: the defaults): checks it whole, then loads what is
 * resident from the start (the router, or a dense bundle's one graph). */
MOBILE_MOE_API mm_status mm_open(const char* bundle_dir, const mm_options* options, mm_model** model);
MOBILE_MOE_API void mm_close(mm_model* model); /* NULL: nothing */

MOBILE_MOE_API int mm_num_classes(const mm_model* model);
MOBILE_MOE_API const char* mm_class_name(const mm_model* model, int index); /* NULL outside 0..classes-1 */
MOBILE_MOE_API int mm_input_channels(const mm_model* model);
MOBILE_MOE_API int mm_input_size(const mm_model* model); /* S: inputs are C x S x S */

/* One image, already resized and normalised as the bundle's manifest says (its input.resize, mean and std):
 * `count` = C * S * S float32 values, channel-major. */
MOBILE_MOE_API mm_status mm_predict_f32(mm_model* model, const float* chw, size_t count);

/* One image as an app has it: 8-bit RGB, `width` x `height` pixels of 3 bytes, `row_stride` bytes from one row to the
 * next (>= 3 * width). Resized and normalised as the bundle's manifest says (input.resize, mean, std): the pixels
 * mobile_moe/preprocess.py would give the same image read from a file, byte for byte (Pillow's resampling). A grey
 * bundle takes Pillow's RGB -> L. Sizes up to 2^15 a side. */
MOBILE_MOE_API mm_status mm_predict_rgb8(mm_model* model, const uint8_t* rgb, int width, int height, int row_stride);
/* The same preprocessing alone, into `chw` (capacity C * S * S values), for an app that runs it elsewhere. */
MOBILE_MOE_API mm_status mm_preprocess_rgb8(const mm_model* model, const uint8_t* rgb, int width, int height,
                                            int row_stride, float* chw, size_t capacity);

/* The last prediction's results (each 0 / nothing before the first): */
MOBILE_MOE_API size_t mm_logits(const mm_model* model, float* logits, size_t capacity); /* -> classes; copies */
/* The k most probable classes (softmax of the logits, computed in double), most probable first; -> how many */
MOBILE_MOE_API int mm_top_classes(const mm_model* model, int k, int* classes, float* probabilities);
/* The experts the image took, highest gate first, and their gates; -> how many (0 for a dense bundle) */
MOBILE_MOE_API int mm_experts(const mm_model* model, int capacity, int* experts, float* gates);
MOBILE_MOE_API void mm_last_times(const mm_model* model, mm_stage_times* times);

#ifdef __cplusplus
}
#endif

#endif /* MOBILE_MOE_H */
