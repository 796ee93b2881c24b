package org.mobilemoe;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.FloatBuffer;

/**
 * A mobile-moe bundle run in this process through libmobile_moe (its C API, mobile_moe.h): what an Android app
 * calls. Failures are exceptions carrying the library's one-line message.
 *
 * <pre>
 *   try (MobileMoe model = MobileMoe.open("/data/app/bundle", 1, 1)) {   // 1 thread, one expert cached
 *     MobileMoe.Prediction p = model.predict(chw);                         // float[] C x S x S, normalised
 *     String best = model.className(p.classes[0]);
 *   }
 * </pre>
 *
 * A MobileMoe is not thread-safe: calls on one object must not overlap (the C API's rule).
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

  private long handle;

  private MobileMoe(long handle) {
    this.handle = handle;
  }

  /** Opens a bundle folder: `threads` inference threads, `cacheExperts` expert graphs resident (0: all). */
  public static MobileMoe open(String bundleDir, int threads, int cacheExperts) {
    return new MobileMoe(nativeOpen(bundleDir, threads, cacheExperts));
  }

  public int numClasses() {
    return nativeNumClasses(live());
  }

  public String className(int index) {
    return nativeClassName(live(), index);
  }

  /** C * S * S: the float values predict takes. */
  public int inputValues() {
    return nativeInputValues(live());
  }

  /** One image, resized and normalised as the bundle's manifest says: C x S x S float32, channel-major. */
  public Prediction predict(float[] chw, int topK) {
    return nativePredict(live(), chw, topK);
  }

  public Prediction predict(float[] chw) {
    return predict(chw, 5);
  }

  /** The same from a buffer of native-order float32 values (a direct ByteBuffer, as a camera pipeline fills). */
  public Prediction predict(ByteBuffer chw, int topK) {
    FloatBuffer values = chw.duplicate().order(ByteOrder.nativeOrder()).asFloatBuffer();
    float[] copy = new float[values.remaining()];
    values.get(copy);
    return predict(copy, topK);
  }

  @Override
  public void close() {
    if (handle != 0) {
      nativeClose(handle);
      handle = 0;
    }
  }

  private long live() {
    if (handle == 0) throw new IllegalStateException("this MobileMoe is closed");
    return handle;
  }

  private static native long nativeOpen(String bundleDir, int threads, int cacheExperts);

  private static native void nativeClose(long handle);

  private static native int nativeNumClasses(long handle);

  private static native String nativeClassName(long handle, int index);

  private static native int nativeInputValues(long handle);

  private static native Prediction nativePredict(long handle, float[] chw, int topK);
}
