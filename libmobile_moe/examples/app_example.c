/* mobile_moe_app: an app's whole use of libmobile_moe (mobile_moe.h) in C, and what benchmarks/library_vit_ti32.py
 * times against the runner: open a bundle, predict each image of a raw float32 file (N x C x S x S, normalised) in
 * turn for --iterations predictions, close. Prints one JSON line: the open (an app's cold start), every prediction's
 * milliseconds, the peak RSS (VmHWM), and every prediction's top class and first expert (-1: a dense bundle).
 *
 *   mobile_moe_app BUNDLE IMAGES.f32 [--iterations N] [--threads T] [--cache-experts N] [--park-experts N]
 *                  [--cache-margin D] [--weight-cache-dir DIR] [--weight-cache-limit-mib MIB] [--prefetch 0|1]
 *
 * Each option is mm_options' field of that name, in its encoding; one left out keeps mm_default_options' value.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mobile_moe.h"

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static long peak_rss_bytes(void) {
  FILE* status = fopen("/proc/self/status", "r");
  char line[256];
  long kb = -1;
  while (status != NULL && fgets(line, sizeof line, status) != NULL)
    if (strncmp(line, "VmHWM:", 6) == 0) kb = strtol(line + 6, NULL, 10);
  if (status != NULL) fclose(status);
  return kb < 0 ? -1 : kb * 1024;
}

/* Image `index` of the raw float32 file into `image` (one at a time, as an app gets them: the process holds one image,
 * so its peak RSS is the model's); 0 when the file has no such image. */
static int read_image(FILE* file, size_t values, size_t index, float* image) {
  return fseek(file, (long)(index * values * sizeof(float)), SEEK_SET) == 0 &&
         fread(image, sizeof(float) * values, 1, file) == 1;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: mobile_moe_app BUNDLE IMAGES.f32 [--iterations N] [--threads T] [--cache-experts N] "
                    "[--park-experts N] [--cache-margin D] [--weight-cache-dir DIR] [--weight-cache-limit-mib MIB] "
                    "[--prefetch 0|1]\n");
    return 2;
  }
  mm_options options;
  mm_default_options(&options);
  int iterations = 50;
  for (int i = 3; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--iterations") == 0) iterations = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--threads") == 0) options.threads = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--cache-experts") == 0) options.cache_experts = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--park-experts") == 0) options.park_experts = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--cache-margin") == 0) options.cache_margin = strtof(argv[i + 1], NULL);
    else if (strcmp(argv[i], "--weight-cache-dir") == 0) options.weight_cache_dir = argv[i + 1];
    else if (strcmp(argv[i], "--weight-cache-limit-mib") == 0) options.weight_cache_limit_mib = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--prefetch") == 0) options.prefetch = atoi(argv[i + 1]);
    else {
      fprintf(stderr, "mobile_moe_app: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  double start = now_ms();
  mm_model* model = NULL;
  if (mm_open(argv[1], &options, &model) != MM_OK) {
    fprintf(stderr, "mobile_moe_app: %s\n", mm_last_error());
    return 2;
  }
  double open_ms = now_ms() - start;
  size_t values = (size_t)mm_input_channels(model) * mm_input_size(model) * mm_input_size(model), count = 0;
  FILE* file = fopen(argv[2], "rb");
  float* image = malloc(values * sizeof(float));
  while (file != NULL && image != NULL && read_image(file, values, count, image)) ++count;
  if (count == 0 || iterations < 1) {
    fprintf(stderr, "mobile_moe_app: cannot read whole images of %zu values from %s\n", values, argv[2]);
    return 2;
  }
  /* each prediction's top class and first expert, printed after the times: reading them is no part of the times */
  int* top = malloc(sizeof(int) * (size_t)iterations);
  int* expert = malloc(sizeof(int) * (size_t)iterations);
  if (top == NULL || expert == NULL) {
    fprintf(stderr, "mobile_moe_app: out of memory\n");
    return 1;
  }
  printf("{\"open_ms\": %.4f, \"ms\": [", open_ms);
  for (int i = 0; i < iterations; ++i) {
    if (!read_image(file, values, (size_t)i % count, image)) {
      fprintf(stderr, "mobile_moe_app: %s changed while it was read\n", argv[2]);
      return 2;
    }
    /* the answer is the call's own, into this loop's arrays: a thread sharing the handle would get its own too */
    mm_result result;
    mm_default_result(&result);
    result.classes = &top[i], result.top_k = 1;
    result.experts = &expert[i], result.experts_capacity = 1;
    double before = now_ms();  /* the prediction alone, as the runner times its own */
    if (mm_predict_f32_into(model, image, values, &result) != MM_OK) {
      fprintf(stderr, "mobile_moe_app: %s\n", mm_last_error());
      return 1;
    }
    printf("%s%.4f", i ? ", " : "", now_ms() - before);
    if (result.num_experts == 0) expert[i] = -1;
  }
  printf("], \"peak_rss_bytes\": %ld, \"first_class\": %d, \"first_expert\": %d, \"classes\": [", peak_rss_bytes(),
         top[0], expert[0]);
  for (int i = 0; i < iterations; ++i) printf("%s%d", i ? ", " : "", top[i]);
  printf("], \"experts\": [");
  for (int i = 0; i < iterations; ++i) printf("%s%d", i ? ", " : "", expert[i]);
  printf("]}\n");
  free(top);
  free(expert);
  mm_close(model);
  fclose(file);
  free(image);
  return 0;
}
