/* The JNI half of org.mobilemoe.MobileMoe (java/org/mobilemoe/): a client of libmobile_moe's C API (mobile_moe.h)
 * like any app; each prediction's answer is the call's own (mm_predict_*_into). The Java side checks arguments and
 * holds the object's lock; here a failed call becomes a MobileMoeException carrying the status and mm_last_error()'s
 * message. Paths arrive as UTF-8 bytes (JNI's own
 * strings are modified UTF-8, which splits a character outside the Basic Multilingual Plane in two). */
#include <jni.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mobile_moe.h"
#include "mobile_moe_measure.h" /* mm_get_model_info: the experts an answer has room for */

#define JNI_EXPORT __attribute__((visibility("default")))

/* Options.set's bits (MobileMoe.java Options): the fields an app set. */
enum { SET_THREADS = 1, SET_CACHE_EXPERTS = 2, SET_PARK_EXPERTS = 4, SET_CACHE_MARGIN = 8, SET_WEIGHT_CACHE_DIR = 16,
       SET_WEIGHT_CACHE_LIMIT = 32, SET_PREFETCH = 64 };

static void throw_named(JNIEnv* env, const char* class_name, const char* message) {
  jclass class_ = (*env)->FindClass(env, class_name);
  if (class_ != NULL) (*env)->ThrowNew(env, class_, message);
}

/* The library's UTF-8 (a message quoting a path, a class name) as a Java string. Not NewStringUTF: it takes modified
 * UTF-8, and Android's CheckJNI aborts on a character outside the Basic Multilingual Plane in standard UTF-8. Decoded
 * to UTF-16 here; a malformed byte becomes U+FFFD. NULL with an exception pending where it cannot be made. */
static jstring java_string(JNIEnv* env, const char* text) {
  const unsigned char* bytes = (const unsigned char*)text;
  size_t length = strlen(text), count = 0;
  jchar* units = malloc(sizeof(jchar) * (length + 1) * 2);
  if (units == NULL) {
    throw_named(env, "java/lang/OutOfMemoryError", "out of memory");
    return NULL;
  }
  for (size_t i = 0; i < length;) {
    const uint32_t lead = bytes[i];
    const int extra = lead < 0x80 ? 0 : lead >= 0xc2 && lead < 0xe0 ? 1 : lead >= 0xe0 && lead < 0xf0 ? 2
                    : lead >= 0xf0 && lead < 0xf5 ? 3 : -1;  /* continuation bytes the lead byte announces */
    uint32_t code = 0xfffd;
    size_t used = 1;
    if (extra >= 0) {
      code = extra == 0 ? lead : lead & (0x7fu >> (extra + 1));
      int k = 1;
      for (; k <= extra && i + (size_t)k < length && (bytes[i + (size_t)k] & 0xc0) == 0x80; ++k)
        code = (code << 6) | (bytes[i + (size_t)k] & 0x3f);
      used = (size_t)k;
      if (k <= extra || (code >= 0xd800 && code <= 0xdfff) || code > 0x10ffff) code = 0xfffd;
    }
    i += used;
    if (code >= 0x10000) {  /* a surrogate pair */
      units[count++] = (jchar)(0xd800 + ((code - 0x10000) >> 10));
      units[count++] = (jchar)(0xdc00 + ((code - 0x10000) & 0x3ff));
    } else {
      units[count++] = (jchar)code;
    }
  }
  jstring string = (*env)->NewString(env, units, (jsize)count);
  free(units);
  return string;
}

static void throw_status(JNIEnv* env, mm_status status) {
  jclass class_ = (*env)->FindClass(env, "org/mobilemoe/MobileMoeException");
  jmethodID init = class_ ? (*env)->GetMethodID(env, class_, "<init>", "(ILjava/lang/String;)V") : NULL;
  jstring message = init ? java_string(env, mm_last_error()) : NULL;
  jobject error = message ? (*env)->NewObject(env, class_, init, (jint)status, message) : NULL;
  if (error != NULL) (*env)->Throw(env, (jthrowable)error);
}

static mm_model* model_of(jlong handle) { return (mm_model*)(intptr_t)handle; }

/* A Java byte[] of UTF-8 as a C string (malloc'd; NULL with an exception pending where it cannot be made). */
static char* c_string(JNIEnv* env, jbyteArray bytes) {
  const jsize length = (*env)->GetArrayLength(env, bytes);
  char* text = malloc((size_t)length + 1);
  if (text == NULL) {
    throw_named(env, "java/lang/OutOfMemoryError", "out of memory");
    return NULL;
  }
  (*env)->GetByteArrayRegion(env, bytes, 0, length, (jbyte*)text);
  text[length] = '\0';
  return text;
}

JNI_EXPORT jstring JNICALL Java_org_mobilemoe_MobileMoe_nativeVersion(JNIEnv* env, jclass cls) {
  (void)cls;
  return java_string(env, mm_version());
}

JNI_EXPORT jlong JNICALL Java_org_mobilemoe_MobileMoe_nativeOpen(JNIEnv* env, jclass cls, jbyteArray bundle_dir,
                                                                 jint set, jint threads, jint cache_experts,
                                                                 jint park_experts, jfloat cache_margin,
                                                                 jbyteArray weight_cache_dir,
                                                                 jint weight_cache_limit_mib, jint prefetch) {
  (void)cls;
  char* path = c_string(env, bundle_dir);
  char* cache = path != NULL && weight_cache_dir != NULL ? c_string(env, weight_cache_dir) : NULL;
  if (path == NULL || (weight_cache_dir != NULL && cache == NULL)) {
    free(path);
    return 0;
  }
  mm_options options;
  mm_default_options(&options);
  if (set & SET_THREADS) options.threads = threads;
  if (set & SET_CACHE_EXPERTS) options.cache_experts = cache_experts;
  if (set & SET_PARK_EXPERTS) options.park_experts = park_experts;
  if (set & SET_CACHE_MARGIN) options.cache_margin = cache_margin;
  if (set & SET_WEIGHT_CACHE_DIR) options.weight_cache_dir = cache;
  if (set & SET_WEIGHT_CACHE_LIMIT) options.weight_cache_limit_mib = weight_cache_limit_mib;
  if (set & SET_PREFETCH) options.prefetch = prefetch;
  mm_model* model = NULL;
  const mm_status status = mm_open(path, &options, &model);
  free(path);
  free(cache);
  if (status != MM_OK) {
    throw_status(env, status);
    return 0;
  }
  return (jlong)(intptr_t)model;
}

JNI_EXPORT void JNICALL Java_org_mobilemoe_MobileMoe_nativeClose(JNIEnv* env, jclass cls, jlong handle) {
  (void)env, (void)cls;
  mm_close(model_of(handle));
}

JNI_EXPORT jint JNICALL Java_org_mobilemoe_MobileMoe_nativeNumClasses(JNIEnv* env, jclass cls, jlong handle) {
  (void)env, (void)cls;
  return mm_num_classes(model_of(handle));
}

JNI_EXPORT jstring JNICALL Java_org_mobilemoe_MobileMoe_nativeClassName(JNIEnv* env, jclass cls, jlong handle,
                                                                        jint index) {
  (void)cls;
  const char* name = mm_class_name(model_of(handle), index);
  return name == NULL ? NULL : java_string(env, name);
}

JNI_EXPORT jint JNICALL Java_org_mobilemoe_MobileMoe_nativeInputValues(JNIEnv* env, jclass cls, jlong handle) {
  (void)env, (void)cls;
  mm_model* model = model_of(handle);
  return mm_input_channels(model) * mm_input_size(model) * mm_input_size(model);
}

/* Java arrays of `count` values; NULL with an exception pending where one cannot be made. */
static jfloatArray float_array(JNIEnv* env, const float* values, jsize count) {
  jfloatArray array = (*env)->NewFloatArray(env, count);
  if (array != NULL && count > 0) (*env)->SetFloatArrayRegion(env, array, 0, count, values);
  return array;
}

static jintArray int_array(JNIEnv* env, const int* values, jsize count) {
  jintArray array = (*env)->NewIntArray(env, count);
  for (jsize i = 0; array != NULL && i < count; ++i) {
    const jint value = values[i];
    (*env)->SetIntArrayRegion(env, array, i, 1, &value);
  }
  return array;
}

/* One call's answer: an mm_result and the arrays it points at, sized by the bundle (its classes, its experts) and not
 * by the app's `top_k` (Integer.MAX_VALUE included), which is bounded by the classes there are. */
typedef struct {
  mm_result result;
  float *logits, *probabilities, *gates;
  int *top, *experts;
} Answer;

static void answer_free(Answer* answer) {
  free(answer->logits), free(answer->probabilities), free(answer->gates), free(answer->top), free(answer->experts);
}

/* 1 when the arrays were had; 0 with an OutOfMemoryError pending. */
static int answer_init(JNIEnv* env, Answer* answer, mm_model* model, jint top_k) {
  const int classes = mm_num_classes(model);
  mm_model_info info;
  const int experts = mm_get_model_info(model, &info) == MM_OK && info.num_experts > 0 ? info.num_experts : 1;
  const int k = top_k < 0 ? 0 : top_k > classes ? classes : (int)top_k;
  memset(answer, 0, sizeof *answer);
  answer->logits = malloc(sizeof(float) * (size_t)(classes > 0 ? classes : 1));
  answer->probabilities = malloc(sizeof(float) * (size_t)(k > 0 ? k : 1));
  answer->top = malloc(sizeof(int) * (size_t)(k > 0 ? k : 1));
  answer->experts = malloc(sizeof(int) * (size_t)experts);
  answer->gates = malloc(sizeof(float) * (size_t)experts);
  if (!answer->logits || !answer->probabilities || !answer->top || !answer->experts || !answer->gates) {
    answer_free(answer);
    throw_named(env, "java/lang/OutOfMemoryError", "out of memory");
    return 0;
  }
  mm_default_result(&answer->result);
  answer->result.logits = answer->logits, answer->result.logits_capacity = (size_t)(classes > 0 ? classes : 0);
  answer->result.classes = answer->top, answer->result.probabilities = answer->probabilities;
  answer->result.top_k = k;
  answer->result.experts = answer->experts, answer->result.gates = answer->gates;
  answer->result.experts_capacity = experts;
  return 1;
}

/* The call's answer as a MobileMoe.Prediction; NULL with an exception pending on failure. Each Java array is made,
 * and checked, before the next JNI call. */
static jobject prediction(JNIEnv* env, const Answer* answer) {
  const mm_result* result = &answer->result;
  const int experts = result->num_experts < result->experts_capacity ? result->num_experts : result->experts_capacity;
  jclass class_ = (*env)->FindClass(env, "org/mobilemoe/MobileMoe$Prediction");
  jmethodID init = class_ ? (*env)->GetMethodID(env, class_, "<init>", "([I[F[F[I[F)V") : NULL;
  jintArray classes_array = init ? int_array(env, answer->top, result->num_top) : NULL;
  jfloatArray probabilities_array = classes_array ? float_array(env, answer->probabilities, result->num_top) : NULL;
  jfloatArray logits_array = probabilities_array ? float_array(env, answer->logits, result->num_classes) : NULL;
  jintArray experts_array = logits_array ? int_array(env, answer->experts, experts) : NULL;
  jfloatArray gates_array = experts_array ? float_array(env, answer->gates, experts) : NULL;
  if (gates_array == NULL) return NULL;
  return (*env)->NewObject(env, class_, init, classes_array, probabilities_array, logits_array, experts_array,
                           gates_array);
}

JNI_EXPORT jobject JNICALL Java_org_mobilemoe_MobileMoe_nativePredict(JNIEnv* env, jclass cls, jlong handle,
                                                                      jfloatArray chw, jint top_k) {
  (void)cls;
  mm_model* model = model_of(handle);
  Answer answer;
  if (!answer_init(env, &answer, model, top_k)) return NULL;
  jsize count = (*env)->GetArrayLength(env, chw);
  jfloat* values = (*env)->GetFloatArrayElements(env, chw, NULL);
  jobject result = NULL;
  if (values != NULL) {
    mm_status status = mm_predict_f32_into(model, values, (size_t)count, &answer.result);
    (*env)->ReleaseFloatArrayElements(env, chw, values, JNI_ABORT);
    if (status != MM_OK) throw_status(env, status);
    else result = prediction(env, &answer);
  }
  answer_free(&answer);
  return result;
}

/* The library's RGB8 call on pixels already in C memory; the prediction, or NULL with an exception pending. */
static jobject predict_rgb8(JNIEnv* env, mm_model* model, const uint8_t* rgb, size_t length, jint width, jint height,
                            jint row_stride, jint top_k) {
  Answer answer;
  if (!answer_init(env, &answer, model, top_k)) return NULL;
  jobject result = NULL;
  mm_status status = mm_predict_rgb8_into(model, rgb, length, width, height, row_stride, &answer.result);
  if (status != MM_OK) throw_status(env, status);
  else result = prediction(env, &answer);
  answer_free(&answer);
  return result;
}

JNI_EXPORT jobject JNICALL Java_org_mobilemoe_MobileMoe_nativePredictRgb(JNIEnv* env, jclass cls, jlong handle,
                                                                         jbyteArray rgb, jint width, jint height,
                                                                         jint row_stride, jint top_k) {
  (void)cls;
  jsize length = (*env)->GetArrayLength(env, rgb);
  jbyte* bytes = (*env)->GetByteArrayElements(env, rgb, NULL);
  if (bytes == NULL) return NULL;
  jobject result = predict_rgb8(env, model_of(handle), (const uint8_t*)bytes, (size_t)length, width, height,
                                row_stride, top_k);
  (*env)->ReleaseByteArrayElements(env, rgb, bytes, JNI_ABORT);
  return result;
}

/* Bitmap.getPixels' ARGB_8888 ints (0xAARRGGBB, `stride` ints a row) as packed RGB8 rows; alpha is dropped, as
 * Pillow's RGBA -> RGB conversion drops it. */
JNI_EXPORT jobject JNICALL Java_org_mobilemoe_MobileMoe_nativePredictArgb(JNIEnv* env, jclass cls, jlong handle,
                                                                          jintArray argb, jint width, jint height,
                                                                          jint stride, jint top_k) {
  (void)cls;
  const size_t row = (size_t)width * 3, length = row * (size_t)height;
  uint8_t* rgb = malloc(length);
  jint* pixels = rgb ? (*env)->GetIntArrayElements(env, argb, NULL) : NULL;
  if (pixels == NULL) {
    free(rgb);
    if (!(*env)->ExceptionCheck(env)) throw_named(env, "java/lang/OutOfMemoryError", "out of memory");
    return NULL;
  }
  for (jint y = 0; y < height; ++y)
    for (jint x = 0; x < width; ++x) {
      const uint32_t pixel = (uint32_t)pixels[(size_t)y * (size_t)stride + (size_t)x];
      uint8_t* out = rgb + (size_t)y * row + (size_t)x * 3;
      out[0] = (uint8_t)(pixel >> 16), out[1] = (uint8_t)(pixel >> 8), out[2] = (uint8_t)pixel;
    }
  (*env)->ReleaseIntArrayElements(env, argb, pixels, JNI_ABORT);
  jobject result = predict_rgb8(env, model_of(handle), rgb, length, width, height, (jint)row, top_k);
  free(rgb);
  return result;
}
