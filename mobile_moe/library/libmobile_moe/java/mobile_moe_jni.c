/* The JNI half of org.mobilemoe.MobileMoe (native/java/): a client of libmobile_moe's C API (mobile_moe.h) like any
 * app. Failures become exceptions carrying mm_last_error()'s message: IllegalArgumentException for a bad argument or
 * bundle, RuntimeException for a runtime failure, OutOfMemoryError. */
#include <jni.h>
#include <stdint.h>
#include <stdlib.h>

#include "mobile_moe.h"

#define JNI_EXPORT __attribute__((visibility("default")))

static void throw_status(JNIEnv* env, mm_status status) {
  const char* type = status == MM_OUT_OF_MEMORY  ? "java/lang/OutOfMemoryError"
                     : status == MM_RUNTIME_ERROR ? "java/lang/RuntimeException"
                                                  : "java/lang/IllegalArgumentException";
  jclass class_ = (*env)->FindClass(env, type);
  if (class_ != NULL) (*env)->ThrowNew(env, class_, mm_last_error());
}

static mm_model* model_of(jlong handle) { return (mm_model*)(intptr_t)handle; }

JNI_EXPORT jlong JNICALL Java_org_mobilemoe_MobileMoe_nativeOpen(JNIEnv* env, jclass cls, jstring bundle_dir,
                                                                 jint threads, jint cache_experts) {
  (void)cls;
  if (bundle_dir == NULL) {
    jclass npe = (*env)->FindClass(env, "java/lang/NullPointerException");
    if (npe != NULL) (*env)->ThrowNew(env, npe, "bundleDir is null");
    return 0;
  }
  const char* path = (*env)->GetStringUTFChars(env, bundle_dir, NULL);
  if (path == NULL) return 0; /* OutOfMemoryError already thrown */
  mm_options options;
  mm_default_options(&options);
  options.threads = threads;
  options.cache_experts = cache_experts;
  mm_model* model = NULL;
  mm_status status = mm_open(path, &options, &model);
  (*env)->ReleaseStringUTFChars(env, bundle_dir, path);
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
  return name == NULL ? NULL : (*env)->NewStringUTF(env, name);
}

JNI_EXPORT jint JNICALL Java_org_mobilemoe_MobileMoe_nativeInputValues(JNIEnv* env, jclass cls, jlong handle) {
  (void)env, (void)cls;
  mm_model* model = model_of(handle);
  return mm_input_channels(model) * mm_input_size(model) * mm_input_size(model);
}

static jfloatArray float_array(JNIEnv* env, const float* values, jsize count) {
  jfloatArray array = (*env)->NewFloatArray(env, count);
  if (array != NULL) (*env)->SetFloatArrayRegion(env, array, 0, count, values);
  return array;
}

static jintArray int_array(JNIEnv* env, const int* values, jsize count) {
  jintArray array = (*env)->NewIntArray(env, count);
  if (array != NULL) {
    jint* copy = (*env)->GetIntArrayElements(env, array, NULL);
    if (copy == NULL) return NULL;
    for (jsize i = 0; i < count; ++i) copy[i] = values[i];
    (*env)->ReleaseIntArrayElements(env, array, copy, 0);
  }
  return array;
}

/* The last prediction of `model` as a MobileMoe.Prediction; NULL with an exception pending on failure. */
static jobject prediction(JNIEnv* env, mm_model* model, jint top_k) {
  size_t classes = mm_logits(model, NULL, 0);
  int experts = mm_experts(model, 0, NULL, NULL);
  int k = top_k < 1 ? 1 : top_k;
  float* logits = malloc(sizeof(float) * (classes ? classes : 1));
  int* top = malloc(sizeof(int) * (size_t)k);
  float* probabilities = malloc(sizeof(float) * (size_t)k);
  int* chosen = malloc(sizeof(int) * (size_t)(experts ? experts : 1));
  float* gates = malloc(sizeof(float) * (size_t)(experts ? experts : 1));
  jobject result = NULL;
  if (logits && top && probabilities && chosen && gates) {
    mm_logits(model, logits, classes);
    int n = mm_top_classes(model, k, top, probabilities);
    mm_experts(model, experts, chosen, gates);
    jclass class_ = (*env)->FindClass(env, "org/mobilemoe/MobileMoe$Prediction");
    jmethodID init = class_ ? (*env)->GetMethodID(env, class_, "<init>", "([I[F[F[I[F)V") : NULL;
    if (init != NULL)
      result = (*env)->NewObject(env, class_, init, int_array(env, top, n), float_array(env, probabilities, n),
                                 float_array(env, logits, (jsize)classes), int_array(env, chosen, experts),
                                 float_array(env, gates, experts));
  } else {
    jclass oom = (*env)->FindClass(env, "java/lang/OutOfMemoryError");
    if (oom != NULL) (*env)->ThrowNew(env, oom, "out of memory");
  }
  free(logits), free(top), free(probabilities), free(chosen), free(gates);
  return result;
}

JNI_EXPORT jobject JNICALL Java_org_mobilemoe_MobileMoe_nativePredict(JNIEnv* env, jclass cls, jlong handle,
                                                                      jfloatArray chw, jint top_k) {
  (void)cls;
  mm_model* model = model_of(handle);
  if (chw == NULL) {
    jclass npe = (*env)->FindClass(env, "java/lang/NullPointerException");
    if (npe != NULL) (*env)->ThrowNew(env, npe, "chw is null");
    return NULL;
  }
  jsize count = (*env)->GetArrayLength(env, chw);
  jfloat* values = (*env)->GetFloatArrayElements(env, chw, NULL);
  if (values == NULL) return NULL;
  mm_status status = mm_predict_f32(model, values, (size_t)count);
  (*env)->ReleaseFloatArrayElements(env, chw, values, JNI_ABORT);
  if (status != MM_OK) {
    throw_status(env, status);
    return NULL;
  }
  return prediction(env, model, top_k);
}
