/* mobile_moe_library_faults: an app's mistakes and orders of calls that mobile_moe.h allows, each run against the
 * library in one process: the tests run it plain and built with AddressSanitizer and ThreadSanitizer. Every scenario
 * prints one JSON line {"scenario": ..., "ok": true|false, "detail": "..."}; exit 0 when it held, 1 when not.
 *
 *   mobile_moe_library_faults SCENARIO BUNDLE IMAGES.f32 [ROUNDS]
 *
 * Scenarios:
 *   pool-order        one thread: a 1-thread handle predicts, a 2-thread handle opens and predicts, the first predicts
 *                     again; a 3-thread handle is refused while the 2-thread one is open, then opens once it closed
 *   one-handle        two threads predict on ONE handle, ROUNDS times each: every answer is the handle's answer alone
 *   shared-handle-results  two threads on ONE handle, each its own images, each answer from its call's mm_result:
 *                     always that image's own answer (the handle's last results would be either thread's)
 *   two-handles       two handles on one bundle, each serving every image ROUNDS times from its own thread at once
 *                     (switching experts as they go, one expert cached): bit for bit as one handle alone
 *   open-while-serving two 1-thread handles serve from two threads while a third thread opens and closes handles of
 *                     1, 2 and 3 threads ROUNDS times: serving answers stay exact, every open succeeds or is refused
 *   misuse            double close, calls after close, NULLs, a row stride or height past the buffer's length
 *   older-app         an app built when mm_options had only its first fields: it opens with the rest defaulted
 *   log-callback      an app's log callback gets the library's failure (naming mm_open) and may call the library
 *   measure-while-serving
 *                     mobile_moe_measure.h on a handle keeping one load's event: a round of switches alone (route,
 *                     unload, load warm or cold, run each expert, read the last load's event and the stats) where
 *                     every call succeeds, then one thread serves every image ROUNDS times while another switches on
 *                     the SAME handle: the answers stay exact, each measurement call succeeds or loses its expert to
 *                     the other thread's prediction in a line; an event's graph name read at open stays valid
 *   full-disk         the default packed-weight folder (MOBILE_MOE_WEIGHT_CACHE: the test mounts a 256 KiB tmpfs
 *                     there), and the same folder passed as options.weight_cache_dir: every open succeeds and
 *                     answers every image exactly, packing in memory, with the log saying there is no room; never a
 *                     SIGBUS from the backend writing its file through a mapping
 *   derived-folder    a per-user folder the app never chose that cannot be used (the test's XDG_CACHE_HOME too long
 *                     for XNNPACK's cache path option; then MOBILE_MOE_WEIGHT_CACHE under a file): the open succeeds
 *                     with the cache off and a line at the log; the same path passed as options.weight_cache_dir is
 *                     refused, MM_BAD_ARGUMENT in one line, and nothing of it made
 *   stray-files       a directory where verified-files.txt belongs, and staged files of a process that is gone, in
 *                     the default folder: each open sweeps those and leaves no staged file of its own; a live
 *                     process's staged file, a file whose name is not ours, and the directory stay
 *   top-k             every capacity an app passes as INT_MAX / SIZE_MAX with buffers as large as the answers: each
 *                     call answers what there is and writes nothing past it (AddressSanitizer watches)
 *
 * Every scenario's answers are compared with those of a handle alone without packed weights on disk (set_up), so the
 * handles under test pack into the default folder (MOBILE_MOE_WEIGHT_CACHE: the tests give each run an empty one)
 * at the same time: two handles of one process packing one graph at once.
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mobile_moe.h"
#include "mobile_moe_measure.h"

typedef struct {
  const char* bundle;
  float* images; /* count x values */
  size_t count, values, classes;
  float* alone; /* count x classes: a 1-thread handle's logits, served alone */
  int rounds;
} Setup;

static int report(const char* scenario, int ok, const char* detail) {
  printf("{\"scenario\": \"%s\", \"ok\": %s, \"detail\": \"", scenario, ok ? "true" : "false");
  for (const char* c = detail; *c; ++c) putchar(*c == '"' || *c == '\\' ? '\'' : *c);
  printf("\"}\n");
  return ok ? 0 : 1;
}

static mm_model* open_with(const Setup* setup, int threads, mm_status* status) {
  mm_options options;
  mm_default_options(&options);
  options.threads = threads;
  mm_model* model = NULL;
  *status = mm_open(setup->bundle, &options, &model);
  return model;
}

/* Image `i` through `model`: 1 when its logits are the ones served alone. */
static int answers(mm_model* model, const Setup* setup, size_t i) {
  float logits[1024];
  if (setup->classes > 1024) return 0;
  if (mm_predict_f32(model, setup->images + i * setup->values, setup->values) != MM_OK) return 0;
  return mm_logits(model, logits, setup->classes) == setup->classes &&
         memcmp(logits, setup->alone + i * setup->classes, setup->classes * sizeof(float)) == 0;
}

static int pool_order(const Setup* setup) {
  mm_status status;
  mm_model* one = open_with(setup, 1, &status);
  if (one == NULL || !answers(one, setup, 0)) return report("pool-order", 0, mm_last_error());
  mm_model* two = open_with(setup, 2, &status);
  if (two == NULL || !answers(two, setup, 1) || !answers(one, setup, 2) || !answers(two, setup, 0))
    return report("pool-order", 0, mm_last_error());
  mm_model* three = open_with(setup, 3, &status);
  if (three != NULL || status != MM_BAD_ARGUMENT || strstr(mm_last_error(), "options.threads 3") == NULL)
    return report("pool-order", 0, "a 3-thread handle opened beside a 2-thread one");
  mm_close(two);
  three = open_with(setup, 3, &status);
  const int ok = three != NULL && answers(three, setup, 1) && answers(one, setup, 1);
  mm_close(three);
  mm_close(one);
  return report("pool-order", ok, ok ? "" : mm_last_error());
}

typedef struct {
  const Setup* setup;
  mm_model* model;
  int rounds, wrong, opened, refused;
  size_t image; /* serve_one_image's image */
} Worker;

static void* serve(void* argument) {
  Worker* worker = argument;
  for (int round = 0; round < worker->rounds; ++round)
    for (size_t i = 0; i < worker->setup->count; ++i) worker->wrong += !answers(worker->model, worker->setup, i);
  return NULL;
}

/* Its own image (the worker's `image`: 0 or 1), over and over, on a handle shared with another worker: the handle's
 * logits are the last prediction's, this thread's or the other's, so anything but one of the two images' answers is
 * a corrupted prediction. */
static void* serve_one_image(void* argument) {
  Worker* worker = argument;
  const Setup* setup = worker->setup;
  float logits[1024];
  for (int round = 0; round < worker->rounds; ++round) {
    if (mm_predict_f32(worker->model, setup->images + worker->image * setup->values, setup->values) != MM_OK ||
        mm_logits(worker->model, logits, setup->classes) != setup->classes) {
      ++worker->wrong;
      continue;
    }
    int either = 0;
    for (size_t image = 0; image < 2; ++image)
      either |= memcmp(logits, setup->alone + image * setup->classes, setup->classes * sizeof(float)) == 0;
    worker->wrong += !either;
  }
  return NULL;
}

static int one_handle(const Setup* setup) {
  mm_status status;
  mm_model* model = open_with(setup, 1, &status);
  if (model == NULL) return report("one-handle", 0, mm_last_error());
  if (setup->count < 2 || setup->classes > 1024) return report("one-handle", 0, "two images of at most 1024 classes");
  Worker workers[2] = {{setup, model, setup->rounds, 0, 0, 0, 0}, {setup, model, setup->rounds, 0, 0, 0, 1}};
  pthread_t threads[2];
  for (int t = 0; t < 2; ++t) pthread_create(&threads[t], NULL, serve_one_image, &workers[t]);
  for (int t = 0; t < 2; ++t) pthread_join(threads[t], NULL);
  mm_close(model);
  char detail[128];
  snprintf(detail, sizeof detail, "%d wrong of %d", workers[0].wrong + workers[1].wrong, 2 * setup->rounds);
  return report("one-handle", workers[0].wrong + workers[1].wrong == 0, detail);
}

/* Its own images (the worker's `image` parity: 0 the even ones, 1 the odd ones), on a handle shared with another
 * worker, each answer read from the call's own mm_result: anything but that image's logits alone is wrong. */
static void* serve_own_results(void* argument) {
  Worker* worker = argument;
  const Setup* setup = worker->setup;
  float logits[1024];
  for (int round = 0; round < worker->rounds; ++round)
    for (size_t i = worker->image; i < setup->count; i += 2) {
      mm_result result;
      mm_default_result(&result);
      result.logits = logits, result.logits_capacity = setup->classes;
      worker->wrong += mm_predict_f32_into(worker->model, setup->images + i * setup->values, setup->values,
                                           &result) != MM_OK ||
                       memcmp(logits, setup->alone + i * setup->classes, setup->classes * sizeof(float)) != 0;
    }
  return NULL;
}

/* Two threads on one handle, no lock of the app's: each gets its own image's answer, every time (mm_result). */
static int shared_handle_results(const Setup* setup) {
  const char* scenario = "shared-handle-results";
  mm_status status;
  mm_model* model = open_with(setup, 1, &status);
  if (model == NULL) return report(scenario, 0, mm_last_error());
  if (setup->count < 2 || setup->classes > 1024) return report(scenario, 0, "two images of at most 1024 classes");
  Worker workers[2] = {{setup, model, setup->rounds, 0, 0, 0, 0}, {setup, model, setup->rounds, 0, 0, 0, 1}};
  pthread_t threads[2];
  for (int t = 0; t < 2; ++t) pthread_create(&threads[t], NULL, serve_own_results, &workers[t]);
  for (int t = 0; t < 2; ++t) pthread_join(threads[t], NULL);
  mm_close(model);
  char detail[128];
  snprintf(detail, sizeof detail, "%d wrong of %d", workers[0].wrong + workers[1].wrong,
           setup->rounds * (int)setup->count);
  return report(scenario, workers[0].wrong + workers[1].wrong == 0, detail);
}

static void* open_and_close(void* argument) {
  Worker* worker = argument;
  for (int round = 0; round < worker->rounds; ++round) {
    mm_status status;
    mm_model* model = open_with(worker->setup, 1 + round % 3, &status);
    if (model != NULL) {
      worker->wrong += !answers(model, worker->setup, (size_t)round % worker->setup->count);
      mm_close(model);
      ++worker->opened;
    } else if (status == MM_BAD_ARGUMENT) {
      ++worker->refused;
    } else {
      ++worker->wrong;
    }
  }
  return NULL;
}

/* Two 1-thread handles serving every image ROUNDS times from two threads at once, and with `opener` a third thread
 * opening and closing handles meanwhile. */
static int serving(const Setup* setup, const char* scenario, int opener) {
  mm_status status;
  mm_model* models[2] = {open_with(setup, 1, &status), open_with(setup, 1, &status)};
  if (models[0] == NULL || models[1] == NULL) return report(scenario, 0, mm_last_error());
  Worker workers[3] = {{setup, models[0], setup->rounds, 0, 0, 0, 0},
                       {setup, models[1], setup->rounds, 0, 0, 0, 0},
                       {setup, NULL, setup->rounds, 0, 0, 0, 0}};
  pthread_t threads[3];
  const int count = opener ? 3 : 2;
  for (int t = 0; t < count; ++t) pthread_create(&threads[t], NULL, t < 2 ? serve : open_and_close, &workers[t]);
  for (int t = 0; t < count; ++t) pthread_join(threads[t], NULL);
  mm_close(models[0]);
  mm_close(models[1]);
  const int wrong = workers[0].wrong + workers[1].wrong + workers[2].wrong;
  char detail[160];
  snprintf(detail, sizeof detail, "%d wrong of %d; the opener opened %d and was refused %d", wrong,
           2 * setup->rounds * (int)setup->count, workers[2].opened, workers[2].refused);
  return report(scenario, wrong == 0 && (!opener || workers[2].opened > 0), detail);
}

static int misuse(const Setup* setup) {
  mm_status status;
  mm_model* model = open_with(setup, 1, &status);
  if (model == NULL) return report("misuse", 0, mm_last_error());
  uint8_t pixels[4 * 4 * 3] = {0};
  const char* failed = NULL;
  if (mm_predict_rgb8(model, pixels, sizeof pixels, 4, 4, 3 * 4 + 3) != MM_BAD_ARGUMENT ||
      strstr(mm_last_error(), "mm_predict_rgb8") == NULL)
    failed = "a row stride past the buffer was taken";
  else if (mm_predict_rgb8(model, pixels, sizeof pixels, 4, 5, 3 * 4) != MM_BAD_ARGUMENT)
    failed = "a height past the buffer was taken";
  else if (mm_predict_rgb8(model, pixels, sizeof pixels, 4, 4, 3 * 4) != MM_OK)
    failed = "an exact buffer was refused";
  else if (mm_predict_f32(model, NULL, setup->values) != MM_BAD_ARGUMENT)
    failed = "a NULL image was taken";
  mm_close(model);
  if (failed == NULL) {
    mm_close(model); /* twice: nothing */
    if (mm_predict_f32(model, setup->images, setup->values) != MM_BAD_ARGUMENT ||
        strstr(mm_last_error(), "not an open handle") == NULL)
      failed = "a prediction on a closed handle was not refused";
    else if (mm_num_classes(model) != 0 || mm_class_name(model, 0) != NULL || mm_logits(model, NULL, 0) != 0)
      failed = "a closed handle still answered";
  }
  return report("misuse", failed == NULL, failed == NULL ? "" : failed);
}

typedef struct {
  const Setup* setup;
  mm_model* model;
  int rounds, failed, lost;
  int switches[2]; /* warm loads, cold (MM_LOAD_COLD) loads */
} Measurer;

/* A measurement call's status: MM_OK, or the race it may lose to the serving thread (the expert it loaded evicted by
 * a prediction before it ran, or the load it asked for pushed out of the kept events); anything else is a failure. */
static int measured(Measurer* measurer, mm_status status) {
  if (status == MM_OK) return 1;
  const char* error = mm_last_error();
  const int lost = status == MM_BAD_ARGUMENT &&
                   (strstr(error, "is not loaded") != NULL || strstr(error, "no longer kept") != NULL);
  measurer->lost += lost;
  measurer->failed += !lost;
  return 0;
}

static void* measure_switches(void* argument) {
  Measurer* measurer = argument;
  mm_model_info info;
  if (!measured(measurer, mm_get_model_info(measurer->model, &info))) return NULL;
  for (int round = 0; round < measurer->rounds; ++round) {
    for (int expert = 0; expert < info.num_experts; ++expert) {
      const float* image = measurer->setup->images + (size_t)expert % measurer->setup->count * measurer->setup->values;
      double ms = 0;
      mm_load_event event;
      mm_memory_stats stats;
      if (!measured(measurer, mm_route_f32(measurer->model, image, measurer->setup->values)) ||
          !measured(measurer, mm_expert_unload(measurer->model, expert)) ||
          !measured(measurer, mm_expert_load(measurer->model, expert, round % 2 ? MM_LOAD_COLD : 0, &ms)) ||
          !measured(measurer, mm_expert_run(measurer->model, expert, &ms)) ||
          !measured(measurer, mm_get_load_event(measurer->model, mm_load_count(measurer->model) - 1, &event)) ||
          !measured(measurer, mm_get_memory_stats(measurer->model, &stats)))
        continue;
      measurer->switches[round % 2] += 1;
    }
  }
  return NULL;
}

static int measure_while_serving(const Setup* setup) {
  const char* scenario = "measure-while-serving";
  mm_options options;
  mm_default_options(&options);
  mm_load_settings load;
  mm_default_load_settings(&load);
  load.kept_loads = 1; /* the open's events are dropped by the first switch: their strings must outlive them */
  mm_model* model = NULL;
  if (mm_open_with(setup->bundle, &options, &load, &model) != MM_OK) return report(scenario, 0, mm_last_error());
  mm_load_event opened;
  if (mm_get_load_event(model, mm_load_count(model) - 1, &opened) != MM_OK) return report(scenario, 0, mm_last_error());
  /* Two rounds alone (warm, then cold loads): nothing to lose to, so every call succeeds */
  Measurer alone = {setup, model, 2, 0, 0, {0, 0}};
  measure_switches(&alone);
  Worker server = {setup, model, setup->rounds, 0, 0, 0, 0};
  Measurer measurer = {setup, model, setup->rounds, 0, 0, {0, 0}};
  pthread_t threads[2];
  pthread_create(&threads[0], NULL, serve, &server);
  pthread_create(&threads[1], NULL, measure_switches, &measurer);
  for (int t = 0; t < 2; ++t) pthread_join(threads[t], NULL);
  /* the open's last graph by name, from the event dropped long ago (a dangling pointer: ASan's report) */
  int named = 0;
  const char* name = NULL;
  for (int g = 0; mm_graph(model, g, &name, NULL) == MM_OK; ++g) named |= strcmp(name, opened.graph) == 0;
  mm_close(model);
  char detail[240];
  snprintf(detail, sizeof detail, "alone: %d warm and %d cold switches, %d lost, %d failed; served: %d wrong of %d, "
           "%d + %d switches, %d lost, %d failed; the open's event named a graph: %d", alone.switches[0],
           alone.switches[1], alone.lost, alone.failed, server.wrong, setup->rounds * (int)setup->count,
           measurer.switches[0], measurer.switches[1], measurer.lost, measurer.failed, named);
  const int held = alone.failed == 0 && alone.lost == 0 && alone.switches[0] > 0 && alone.switches[1] > 0 &&
                   server.wrong == 0 && measurer.failed == 0 && named;
  return report(scenario, held, detail);
}

typedef struct {
  pthread_mutex_t mutex;
  int lines, errors, calls;
} LogSeen;

/* An app's log callback: counts the lines, and calls the library where the header allows it (not on a handle). */
static void seen(mm_log_level level, const char* message, void* user_data) {
  LogSeen* log = user_data;
  mm_log_set(seen, user_data); /* the same callback again: set from inside a callback, without waiting on itself */
  const int called = mm_version_number() == MOBILE_MOE_VERSION;
  pthread_mutex_lock(&log->mutex);
  log->lines += 1;
  log->errors += level == MM_LOG_ERROR && strstr(message, "mm_open") != NULL;
  log->calls += called;
  pthread_mutex_unlock(&log->mutex);
}

static int log_callback(const Setup* setup) {
  LogSeen log = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0};
  mm_log_set(seen, &log);
  mm_model* model = NULL;
  const int refused = mm_open("/nonexistent/bundle", NULL, &model) == MM_BAD_BUNDLE;
  mm_status status;
  model = open_with(setup, 1, &status);
  const int ok = refused && model != NULL && answers(model, setup, 0) && log.errors == 1 && log.calls == log.lines;
  mm_close(model);
  mm_log_set(NULL, NULL);
  char detail[128];
  snprintf(detail, sizeof detail, "%d lines, %d errors naming mm_open, %d calls back", log.lines, log.errors, log.calls);
  return report("log-callback", ok, detail);
}

/* The log lines that hold `wanted`, at `level`, counted (thread-safe: ExecuTorch may log from its threads). */
typedef struct {
  pthread_mutex_t mutex;
  const char* wanted;
  mm_log_level level;
  int lines;
} LogCount;

static void count_line(mm_log_level level, const char* message, void* user_data) {
  LogCount* log = user_data;
  pthread_mutex_lock(&log->mutex);
  log->lines += level == log->level && strstr(message, log->wanted) != NULL;
  pthread_mutex_unlock(&log->mutex);
}

/* Every image through `model`: 1 when each answer is the one served alone. */
static int answers_all(mm_model* model, const Setup* setup) {
  for (size_t i = 0; i < setup->count; ++i)
    if (!answers(model, setup, i)) return 0;
  return 1;
}

/* A handle opened on `folder` (NULL: the default one) that answers every image exactly, closed; else why not. */
static const char* opens_and_answers(const Setup* setup, const char* folder) {
  mm_options options;
  mm_default_options(&options);
  options.weight_cache_dir = folder;
  mm_model* model = NULL;
  if (mm_open(setup->bundle, &options, &model) != MM_OK) return mm_last_error();
  const int right = answers_all(model, setup);
  mm_close(model);
  return right ? NULL : "an answer differs from the one served alone";
}

static int full_disk(const Setup* setup) {
  const char* folder = getenv("MOBILE_MOE_WEIGHT_CACHE");
  if (folder == NULL) return report("full-disk", 0, "no MOBILE_MOE_WEIGHT_CACHE");
  LogCount log = {PTHREAD_MUTEX_INITIALIZER, "no room", MM_LOG_ERROR, 0};
  mm_log_set(count_line, &log);
  const char* failed = opens_and_answers(setup, NULL);
  const int by_default = log.lines;
  if (failed == NULL) failed = opens_and_answers(setup, folder);
  mm_log_set(NULL, NULL);
  char detail[512];
  snprintf(detail, sizeof detail, "%s; %d lines saying there is no room (%d through the default folder)",
           failed ? failed : "every answer exact", log.lines, by_default);
  return report("full-disk", failed == NULL && by_default > 0 && log.lines > by_default, detail);
}

/* The per-user folder as packed_cache.h default_cache_dir derives it from XDG_CACHE_HOME. */
static int derived_folder(const Setup* setup) {
  const char* xdg = getenv("XDG_CACHE_HOME");
  char derived[4096];
  if (xdg == NULL || getenv("MOBILE_MOE_WEIGHT_CACHE") != NULL || getenv("MOBILE_MOE_CACHE") != NULL)
    return report("derived-folder", 0, "give XDG_CACHE_HOME alone");
  snprintf(derived, sizeof derived, "%s/mobile-moe/packed-weights", xdg);
  LogCount log = {PTHREAD_MUTEX_INITIALIZER, "packed-weight cache off", MM_LOG_INFO, 0};
  mm_log_set(count_line, &log);
  mm_options options;
  mm_default_options(&options);
  mm_model* model = NULL;
  const char* failed = NULL;
  mm_model_info info;
  if (mm_open(setup->bundle, &options, &model) != MM_OK) failed = mm_last_error();
  else if (mm_get_model_info(model, &info) != MM_OK || info.weight_cache_dir[0] != '\0') failed = "the cache was on";
  else if (!answers_all(model, setup)) failed = "an answer differs from the one served alone";
  mm_close(model);
  struct stat made;
  char root[4200];
  snprintf(root, sizeof root, "%s/mobile-moe", xdg);
  const int too_long_said = log.lines;
  options.weight_cache_dir = derived;  /* chosen by the app: refused */
  if (failed == NULL && (mm_open(setup->bundle, &options, &model) != MM_BAD_ARGUMENT ||
                         strstr(mm_last_error(), "too long") == NULL || strchr(mm_last_error(), '\n') != NULL))
    failed = "an app's folder too long was not refused in a line";
  else if (failed == NULL && stat(root, &made) == 0)
    failed = "a part of a folder too long was made";
  char file_below[4200];  /* a per-user folder that cannot be made: under the bundle's manifest, a file */
  snprintf(file_below, sizeof file_below, "%s/manifest.json/packed-weights", setup->bundle);
  setenv("MOBILE_MOE_WEIGHT_CACHE", file_below, 1);
  if (failed == NULL) failed = opens_and_answers(setup, NULL);
  unsetenv("MOBILE_MOE_WEIGHT_CACHE");
  mm_log_set(NULL, NULL);
  char detail[600];
  snprintf(detail, sizeof detail, "%s; %d lines at the log saying the cache is off", failed ? failed : "held",
           log.lines);
  return report("derived-folder", failed == NULL && too_long_said == 1 && log.lines == 2, detail);
}

/* How many of `folder`'s names start with `prefix`. */
static int count_named(const char* folder, const char* prefix) {
  DIR* dir = opendir(folder);
  int count = 0;
  for (struct dirent* item; dir != NULL && (item = readdir(dir)) != NULL;)
    count += strncmp(item->d_name, prefix, strlen(prefix)) == 0;
  if (dir != NULL) closedir(dir);
  return count;
}

static int touch(const char* folder, const char* name) {
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", folder, name);
  FILE* file = fopen(path, "w");
  return file != NULL && fclose(file) == 0;
}

static int stray_files(const Setup* setup) {
  const char* folder = getenv("MOBILE_MOE_WEIGHT_CACHE");
  char path[4200], host[256] = "", name[512];
  if (folder == NULL) return report("stray-files", 0, "no MOBILE_MOE_WEIGHT_CACHE");
  snprintf(path, sizeof path, "%s/verified-files.txt", folder);
  gethostname(host, sizeof host - 1);
  host[strcspn(host, ".")] = '\0';
  const long gone = 999999999; /* beyond any pid_max: a process that is not running */
  int made = (mkdir(folder, 0755) == 0 || errno == EEXIST) && mkdir(path, 0755) == 0;
  snprintf(name, sizeof name, "verified-files.txt.tmp-%ld-0", gone); /* as the library named them before */
  made = made && touch(folder, name);
  snprintf(name, sizeof name, "verified-files.txt.tmp-%ld-00000002@%s", gone, host);
  made = made && touch(folder, name);
  snprintf(name, sizeof name, "0123456789abcdef0123456789abcdef.xnnpack.tmp-%ld-00000001@%s.check", gone, host);
  made = made && touch(folder, name);
  snprintf(name, sizeof name, "verified-files.txt.tmp-%ld-00000000@%s", (long)getppid(), host); /* a live one's */
  made = made && touch(folder, name) && touch(folder, "notes.txt.tmp-999999999-0"); /* not ours */
  if (!made) return report("stray-files", 0, "cannot lay out the folder");
  const char* failed = NULL;
  for (int open = 0; open < 2 && failed == NULL; ++open) {
    failed = opens_and_answers(setup, NULL);
    if (failed == NULL && count_named(folder, "verified-files.txt.tmp-") != 1)
      failed = "staged verified-files lists are left, or a live process's was removed";
    else if (failed == NULL && count_named(folder, "0123456789abcdef0123456789abcdef.xnnpack.tmp-") != 0)
      failed = "a gone process's staged packed-weight file was left";
  }
  struct stat info;
  if (failed == NULL && (stat(path, &info) != 0 || !S_ISDIR(info.st_mode) ||
                         count_named(folder, "notes.txt.tmp-") != 1))
    failed = "a file that is not ours was removed";
  return report("stray-files", failed == NULL, failed == NULL ? "" : failed);
}

static int top_k(const Setup* setup) {
  mm_status status;
  mm_model* model = open_with(setup, 1, &status);
  if (model == NULL) return report("top-k", 0, mm_last_error());
  const int classes = mm_num_classes(model);
  int* top = malloc(sizeof(int) * (size_t)classes);
  float* probabilities = malloc(sizeof(float) * (size_t)classes);
  float* logits = malloc(sizeof(float) * (size_t)classes);
  int experts[64];
  float gates[64];
  const char* failed = NULL;
  if (top == NULL || probabilities == NULL || logits == NULL || !answers(model, setup, 0))
    failed = "no prediction to read";
  else if (mm_top_classes(model, INT_MAX, top, probabilities) != classes)
    failed = "mm_top_classes(INT_MAX) did not answer every class";
  else if (mm_logits(model, logits, SIZE_MAX) != (size_t)classes)
    failed = "mm_logits(SIZE_MAX) did not answer every logit";
  else if (mm_experts(model, 0, NULL, NULL) > 64 || mm_experts(model, INT_MAX, experts, gates) < 1)
    failed = "mm_experts(INT_MAX) did not answer the chosen experts";
  mm_close(model);
  free(top), free(probabilities), free(logits);
  return report("top-k", failed == NULL, failed == NULL ? "" : failed);
}

/* mm_options as an app built against an older header had it: the first fields only. */
typedef struct {
  size_t struct_size;
  int threads;
  int cache_experts;
} older_options;

static int older_app(const Setup* setup) {
  older_options options;
  mm_options_init((mm_options*)&options, sizeof options);
  if (options.struct_size != sizeof options || options.threads != 1)
    return report("older-app", 0, "mm_options_init wrote other than the app's fields");
  mm_model* model = NULL;
  if (mm_open(setup->bundle, (const mm_options*)&options, &model) != MM_OK)
    return report("older-app", 0, mm_last_error());
  const int ok = answers(model, setup, 0);
  mm_close(model);
  options.struct_size = 0; /* never initialised */
  if (mm_open(setup->bundle, (const mm_options*)&options, &model) != MM_BAD_ARGUMENT ||
      strstr(mm_last_error(), "mm_default_options") == NULL)
    return report("older-app", 0, "options never initialised were taken");
  return report("older-app", ok, ok ? "" : "its answer differs");
}

static float* read_images(const char* path, size_t values, size_t* count) {
  FILE* file = fopen(path, "rb");
  long bytes = -1;
  if (file != NULL && fseek(file, 0, SEEK_END) == 0) bytes = ftell(file);
  *count = bytes > 0 ? (size_t)bytes / (values * sizeof(float)) : 0;
  float* images = *count ? malloc(*count * values * sizeof(float)) : NULL;
  if (images != NULL && (fseek(file, 0, SEEK_SET) != 0 || fread(images, values * sizeof(float), *count, file) != *count)) {
    free(images);
    images = NULL;
  }
  if (file != NULL) fclose(file);
  return images;
}

/* The images, and each one's logits from a 1-thread handle alone. 0 when they cannot be had. */
static int set_up(Setup* setup, const char* images_path) {
  mm_options options;
  mm_default_options(&options);
  options.weight_cache_dir = ""; /* none: the default folder stays empty for the scenario */
  mm_model* model = NULL;
  if (mm_open(setup->bundle, &options, &model) != MM_OK) return 0;
  setup->values = (size_t)mm_input_channels(model) * mm_input_size(model) * mm_input_size(model);
  setup->classes = (size_t)mm_num_classes(model);
  setup->images = read_images(images_path, setup->values, &setup->count);
  setup->alone = setup->images ? malloc(setup->count * setup->classes * sizeof(float)) : NULL;
  int ok = setup->alone != NULL;
  for (size_t i = 0; ok && i < setup->count; ++i)
    ok = mm_predict_f32(model, setup->images + i * setup->values, setup->values) == MM_OK &&
         mm_logits(model, setup->alone + i * setup->classes, setup->classes) == setup->classes;
  mm_close(model);
  return ok;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: mobile_moe_library_faults SCENARIO BUNDLE IMAGES.f32 [ROUNDS]\n");
    return 2;
  }
  Setup setup = {argv[2], NULL, 0, 0, 0, NULL, argc > 4 ? atoi(argv[4]) : 20};
  if (setup.rounds < 1 || !set_up(&setup, argv[3])) {
    fprintf(stderr, "mobile_moe_library_faults: cannot set up: %s\n", mm_last_error());
    return 2;
  }
  const char* scenario = argv[1];
  int status = 2;
  if (strcmp(scenario, "pool-order") == 0) status = pool_order(&setup);
  else if (strcmp(scenario, "one-handle") == 0) status = one_handle(&setup);
  else if (strcmp(scenario, "shared-handle-results") == 0) status = shared_handle_results(&setup);
  else if (strcmp(scenario, "two-handles") == 0) status = serving(&setup, scenario, 0);
  else if (strcmp(scenario, "open-while-serving") == 0) status = serving(&setup, scenario, 1);
  else if (strcmp(scenario, "misuse") == 0) status = misuse(&setup);
  else if (strcmp(scenario, "older-app") == 0) status = older_app(&setup);
  else if (strcmp(scenario, "log-callback") == 0) status = log_callback(&setup);
  else if (strcmp(scenario, "measure-while-serving") == 0) status = measure_while_serving(&setup);
  else if (strcmp(scenario, "full-disk") == 0) status = full_disk(&setup);
  else if (strcmp(scenario, "derived-folder") == 0) status = derived_folder(&setup);
  else if (strcmp(scenario, "stray-files") == 0) status = stray_files(&setup);
  else if (strcmp(scenario, "top-k") == 0) status = top_k(&setup);
  else fprintf(stderr, "mobile_moe_library_faults: no scenario %s\n", scenario);
  free(setup.alone);
  free(setup.images);
  return status;
}
