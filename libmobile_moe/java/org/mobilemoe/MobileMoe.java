package org.mobilemoe;

import java.nio.charset.StandardCharsets;
import java.util.concurrent.locks.ReentrantLock;

/**
 * A mobile-moe bundle run in this process through libmobile_moe (its C API, mobile_moe.h): what an Android app calls.
 *
 * <pre>
 *   try (MobileMoe model = MobileMoe.open("/data/user/0/app/files/bundle",
 *            new MobileMoe.Options().weightCacheDir(context.getCacheDir() + "/mobile-moe"))) {
 *     int[] argb = new int[w * h];
 *     bitmap.getPixels(argb, 0, w, 0, 0, w, h);                  // ARGB_8888, as Bitmap gives it
 *     MobileMoe.Prediction p = model.predictArgb(argb, w, h, w, 5);
 *     String best = model.className(p.classes[0]);
 *   }
 * </pre>
 *
 * <p>Failures of the library throw {@link MobileMoeException} with its status and one-line message, options out of
 * range among them (the library owns their bounds); a call's arguments out of range throw IllegalArgumentException or
 * IndexOutOfBoundsException before the library is called, nulls NullPointerException. Calls on one object from
 * several threads are serialised, each returning its own Prediction; {@link #close} while another thread predicts
 * throws IllegalStateException (as ExecuTorch's Android Module does), and any call after close does too.
 */
public final class MobileMoe implements AutoCloseable {
  static {
    System.loadLibrary("mobile_moe_jni");
  }

  /** What one image gave: its top classes with their probabilities, every logit, the experts and their gates. */
  public static final class Prediction {
    public final int[] classes;
    public final float[] probabilities;
    public final float[] logits;
    public final int[] experts;
    public final float[] gates;

    Prediction(int[] classes, float[] probabilities, float[] logits, int[] experts, float[] gates) {
      this.classes = classes;
      this.probabilities = probabilities;
      this.logits = logits;
      this.experts = experts;
      this.gates = gates;
    }
  }

  /**
   * mm_options, a chainable setter per field (its name in camelCase), each value in the C encoding. The library owns
   * the defaults and the bounds (mobile_moe/library/options.py is their table): a field not set keeps
   * mm_default_options' value (one thread, the bundle's top_k experts in memory, every evicted expert parked, packed
   * weights in the per-user cache folder: an Android app passes its own, {@code context.getCacheDir()}), and a value
   * out of range is refused by {@link MobileMoe#open} with a {@link MobileMoeException} (MM_BAD_ARGUMENT) naming it.
   */
  public static final class Options {
    // Only the fields an app set go to the library; the rest stay mm_default_options' (one owner of the defaults).
    static final int THREADS = 1, CACHE_EXPERTS = 2, PARK_EXPERTS = 4, CACHE_MARGIN = 8, WEIGHT_CACHE_DIR = 16,
        WEIGHT_CACHE_LIMIT = 32, PREFETCH = 64;
    int set;
    int threads, cacheExperts, parkExperts, weightCacheLimitMib, prefetch;
    float cacheMargin;
    String weightCacheDir;

    /** 1: the calling thread alone (default); N > 1: ExecuTorch's shared pool at N threads; 0: the pool as it is. */
    public Options threads(int threads) {
      this.threads = threads;
      set |= THREADS;
      return this;
    }

    /** Expert graphs kept loaded: -1 the bundle's top_k (default), 0 every expert, N that many. */
    public Options cacheExperts(int experts) {
      this.cacheExperts = experts;
      set |= CACHE_EXPERTS;
      return this;
    }

    /** Evicted experts that keep their methods with their weights' pages dropped: -1 every one (default), 0 none. */
    public Options parkExperts(int experts) {
      this.parkExperts = experts;
      set |= PARK_EXPERTS;
      return this;
    }

    /** Cache-aware routing: a loaded expert within this gate margin of the top one is taken (0..1, default 0). */
    public Options cacheMargin(float margin) {
      this.cacheMargin = margin;
      set |= CACHE_MARGIN;
      return this;
    }

    /** XNNPACK's packed weights on disk: a folder (made if missing), "" for none, null for the per-user default. */
    public Options weightCacheDir(String folder) {
      this.weightCacheDir = folder;
      set |= WEIGHT_CACHE_DIR;
      return this;
    }

    /** What the packed-weight folder may hold, in MiB (default 1024). */
    public Options weightCacheLimitMib(int mib) {
      this.weightCacheLimitMib = mib;
      set |= WEIGHT_CACHE_LIMIT;
      return this;
    }

    /** 1 (default): a missed expert loads on a second thread while the trunk's tail runs; 0: in line. */
    public Options prefetch(int prefetch) {
      this.prefetch = prefetch;
      set |= PREFETCH;
      return this;
    }

    /** prefetch(1) or prefetch(0), as 2.1's binding took it. */
    @Deprecated
    public Options prefetch(boolean prefetch) {
      return prefetch(prefetch ? 1 : 0);
    }
  }

  private final ReentrantLock lock = new ReentrantLock();
  private long handle;
  private final int classes;
  private final int inputValues;

  private MobileMoe(long handle) {
    this.handle = handle;
    this.classes = nativeNumClasses(handle);
    this.inputValues = nativeInputValues(handle);
  }

  /** Opens a bundle folder with the library's default options. */
  public static MobileMoe open(String bundleDir) {
    return open(bundleDir, new Options());
  }

  /**
   * Opens a bundle folder with {@code new Options().threads(threads).cacheExperts(cacheExperts)}: inference threads
   * (1: the calling thread) and expert graphs kept loaded (-1: the bundle's top_k, 0: every expert, N: N).
   */
  public static MobileMoe open(String bundleDir, int threads, int cacheExperts) {
    return open(bundleDir, new Options().threads(threads).cacheExperts(cacheExperts));
  }

  public static MobileMoe open(String bundleDir, Options options) {
    if (bundleDir == null) throw new NullPointerException("bundleDir is null");
    if (options == null) throw new NullPointerException("options is null");
    byte[] weightCacheDir = options.weightCacheDir == null ? null : path(options.weightCacheDir, "weightCacheDir");
    return new MobileMoe(nativeOpen(path(bundleDir, "bundleDir"), options.set, options.threads, options.cacheExperts,
        options.parkExperts, options.cacheMargin, weightCacheDir, options.weightCacheLimitMib, options.prefetch));
  }

  /** "mobile-moe libmobile_moe MAJOR.MINOR.PATCH, executorch-VERSION": the library this binding runs with. */
  public static String version() {
    return nativeVersion();
  }

  public int numClasses() {
    live();
    return classes;
  }

  /** The name of class `index`, 0..numClasses()-1. */
  public String className(int index) {
    if (index < 0 || index >= numClasses())
      throw new IndexOutOfBoundsException("class " + index + " is outside 0.." + (classes - 1));
    lock.lock();
    try {
      return nativeClassName(live(), index);
    } finally {
      lock.unlock();
    }
  }

  /** C * S * S: the float values predict takes. */
  public int inputValues() {
    live();
    return inputValues;
  }

  /** One image, resized and normalised as the bundle's manifest says: C x S x S float32, channel-major. */
  public Prediction predict(float[] chw, int topK) {
    if (chw == null) throw new NullPointerException("chw is null");
    if (chw.length != inputValues())
      throw new IllegalArgumentException(chw.length + " values, not the bundle's " + inputValues + " (C x S x S)");
    checkTopK(topK);
    lock.lock();
    try {
      return nativePredict(live(), chw, topK);
    } finally {
      lock.unlock();
    }
  }

  public Prediction predict(float[] chw) {
    return predict(chw, 5);
  }

  /**
   * One image as Bitmap.getPixels gives it: ARGB_8888 ints (0xAARRGGBB, alpha ignored), `width` x `height` pixels,
   * `stride` pixels (ints) from one row to the next (>= width: getPixels' own stride argument); resized and normalised
   * by the library as the bundle's manifest says (mobile_moe.h mm_predict_rgb8). `topK`: how many classes the
   * prediction lists, most probable first (0: none; every logit comes back whatever it is).
   */
  public Prediction predictArgb(int[] argb, int width, int height, int stride, int topK) {
    if (argb == null) throw new NullPointerException("argb is null");
    checkImage(argb.length, width, height, stride, 1);
    checkTopK(topK);
    lock.lock();
    try {
      return nativePredictArgb(live(), argb, width, height, stride, topK);
    } finally {
      lock.unlock();
    }
  }

  /**
   * One image as 8-bit RGB bytes (R, G, B a pixel), `width` x `height` pixels, `rowStride` BYTES from one row to the
   * next (>= 3 * width); `topK` as predictArgb's.
   */
  public Prediction predictRgb(byte[] rgb, int width, int height, int rowStride, int topK) {
    if (rgb == null) throw new NullPointerException("rgb is null");
    checkImage(rgb.length, width, height, rowStride, 3);
    checkTopK(topK);
    lock.lock();
    try {
      return nativePredictRgb(live(), rgb, width, height, rowStride, topK);
    } finally {
      lock.unlock();
    }
  }

  /** Frees the bundle. Twice: nothing. While another thread predicts on this object: IllegalStateException. */
  @Override
  public void close() {
    if (!lock.tryLock())
      throw new IllegalStateException("this MobileMoe is predicting on another thread; close it when that ends");
    try {
      if (handle != 0) {
        nativeClose(handle);
        handle = 0;
      }
    } finally {
      lock.unlock();
    }
  }

  private long live() {
    if (handle == 0) throw new IllegalStateException("this MobileMoe is closed");
    return handle;
  }

  private static void checkTopK(int topK) {
    if (topK < 0) throw new IllegalArgumentException("topK " + topK + " is negative");
  }

  /** `values` entries of `perPixel` each, rows `stride` apart: the last row needs only its own pixels. */
  private static void checkImage(int values, int width, int height, int stride, int perPixel) {
    if (width < 1 || height < 1 || width > 32768 || height > 32768)
      throw new IllegalArgumentException(width + " x " + height + " pixels: sides 1..32768");
    String unit = perPixel == 1 ? " pixels" : " bytes";
    if (stride < (long) width * perPixel)
      throw new IllegalArgumentException("a row stride of " + stride + unit + " is shorter than a row of " + width
          + " pixels (" + (long) width * perPixel + unit + "); pass the stride in" + unit);
    long needed = (long) (height - 1) * stride + (long) width * perPixel;
    if (needed > values)
      throw new IndexOutOfBoundsException(width + " x " + height + " pixels with a stride of " + stride + unit
          + " need " + needed + " array entries; the array holds " + values);
  }

  /** A path as the C library takes it: UTF-8 (not JNI's modified UTF-8, which splits characters outside the BMP). */
  private static byte[] path(String path, String name) {
    if (path.indexOf('\0') >= 0) throw new IllegalArgumentException(name + " holds a NUL character");
    return path.getBytes(StandardCharsets.UTF_8);
  }

  private static native String nativeVersion();

  private static native long nativeOpen(byte[] bundleDir, int set, int threads, int cacheExperts, int parkExperts,
      float cacheMargin, byte[] weightCacheDir, int weightCacheLimitMib, int prefetch);

  private static native void nativeClose(long handle);

  private static native int nativeNumClasses(long handle);

  private static native String nativeClassName(long handle, int index);

  private static native int nativeInputValues(long handle);

  private static native Prediction nativePredict(long handle, float[] chw, int topK);

  private static native Prediction nativePredictArgb(long handle, int[] argb, int width, int height, int stride,
      int topK);

  private static native Prediction nativePredictRgb(long handle, byte[] rgb, int width, int height, int rowStride,
      int topK);
}
