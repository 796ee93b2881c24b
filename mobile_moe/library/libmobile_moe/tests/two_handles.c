/* mobile_moe_two_handles: what mobile_moe.h promises two threads, checked: two handles on one bundle, each serving
 * every image of a raw float32 file ROUNDS times from its own thread at once (switching experts as it goes, one expert
 * cached), answer each image exactly as one handle alone did. The tests run it plain and built with ThreadSanitizer.
 * Prints one JSON line {"predictions": N, "same": true|false}; exit 0 when every answer was the same, 1 when not.
 *
 *   mobile_moe_two_handles BUNDLE IMAGES.f32 [ROUNDS]
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mobile_moe.h"

typedef struct {
  mm_model* model;
  const float* images; /* count x values */
  const float* alone;  /* count x classes: one handle's logits, served alone */
  size_t count, values, classes;
  int rounds, predictions, same;
} Server;

/* Every image through `model`; its logits into `logits` (count x classes). 0 on a failed prediction. */
static int predict_all(mm_model* model, const float* images, size_t count, size_t values, float* logits,
                       size_t classes) {
  for (size_t i = 0; i < count; ++i) {
    if (mm_predict_f32(model, images + i * values, values) != MM_OK) return 0;
    mm_logits(model, logits + i * classes, classes);
  }
  return 1;
}

static void* serve(void* argument) {
  Server* server = argument;
  float* logits = malloc(server->count * server->classes * sizeof(float));
  server->same = logits != NULL;
  for (int round = 0; round < server->rounds && server->same; ++round) {
    server->same = predict_all(server->model, server->images, server->count, server->values, logits, server->classes) &&
                   memcmp(logits, server->alone, server->count * server->classes * sizeof(float)) == 0;
    server->predictions += (int)server->count;
  }
  free(logits);
  return NULL;
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

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: mobile_moe_two_handles BUNDLE IMAGES.f32 [ROUNDS]\n");
    return 2;
  }
  const int rounds = argc > 3 ? atoi(argv[3]) : 5;
  if (rounds < 1) {
    fprintf(stderr, "mobile_moe_two_handles: ROUNDS is a whole number of at least 1, not '%s'\n", argv[3]);
    return 2;
  }
  mm_options options;
  mm_default_options(&options);
  options.cache_experts = 1;
  mm_model* models[2] = {NULL, NULL};
  for (int m = 0; m < 2; ++m)
    if (mm_open(argv[1], &options, &models[m]) != MM_OK) {
      fprintf(stderr, "mobile_moe_two_handles: %s\n", mm_last_error());
      return 2;
    }
  const size_t values = (size_t)mm_input_channels(models[0]) * mm_input_size(models[0]) * mm_input_size(models[0]);
  const size_t classes = (size_t)mm_num_classes(models[0]);
  size_t count = 0;
  float* images = read_images(argv[2], values, &count);
  float* alone = images ? malloc(count * classes * sizeof(float)) : NULL;
  if (alone == NULL || !predict_all(models[0], images, count, values, alone, classes)) {
    fprintf(stderr, "mobile_moe_two_handles: cannot predict whole images of %zu values from %s\n", values, argv[2]);
    return 2;
  }
  Server servers[2];
  pthread_t threads[2];
  for (int m = 0; m < 2; ++m) {
    servers[m] = (Server){models[m], images, alone, count, values, classes, rounds, 0, 0};
    pthread_create(&threads[m], NULL, serve, &servers[m]);
  }
  for (int m = 0; m < 2; ++m) pthread_join(threads[m], NULL);
  const int same = servers[0].same && servers[1].same;
  printf("{\"predictions\": %d, \"same\": %s}\n", servers[0].predictions + servers[1].predictions,
         same ? "true" : "false");
  for (int m = 0; m < 2; ++m) mm_close(models[m]);
  free(alone);
  free(images);
  return same ? 0 : 1;
}
