// The Java binding under CTest: org.mobilemoe.MobileMoe on the library's test data (tests/data), with no Python.
// Each image's answer alone; two threads sharing one MobileMoe each get exactly their own images' answers; an option
// out of range is the library's refusal (MobileMoeException, MM_BAD_ARGUMENT); a call after close is refused.
//
//   java -Djava.library.path=BUILD -cp mobile-moe.jar:tests JavaBindingTest BUNDLE IMAGES.f32
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.Arrays;
import java.util.concurrent.atomic.AtomicInteger;
import org.mobilemoe.MobileMoe;
import org.mobilemoe.MobileMoeException;

public final class JavaBindingTest {
  private static void check(boolean held, String what) {
    if (!held) throw new AssertionError(what);
  }

  private static float[][] images(String path, int values) throws IOException {
    ByteBuffer bytes = ByteBuffer.wrap(Files.readAllBytes(Paths.get(path))).order(ByteOrder.LITTLE_ENDIAN);
    float[][] images = new float[bytes.remaining() / 4 / values][values];
    for (float[] image : images) {
      bytes.asFloatBuffer().get(image);
      bytes.position(bytes.position() + 4 * values);
    }
    return images;
  }

  public static void main(String[] args) throws Exception {
    String bundle = args[0];
    MobileMoe.Options noCache = new MobileMoe.Options().weightCacheDir("");
    try (MobileMoe model = MobileMoe.open(bundle, noCache)) {
      float[][] images = images(args[1], model.inputValues());
      check(images.length >= 2, "at least two images");
      float[][] alone = new float[images.length][];
      for (int i = 0; i < images.length; ++i) alone[i] = model.predict(images[i]).logits;
      AtomicInteger wrong = new AtomicInteger();
      Thread[] threads = new Thread[2];
      for (int t = 0; t < 2; ++t) {
        final int first = t;
        threads[t] = new Thread(() -> {
          for (int round = 0; round < 20; ++round)
            for (int i = first; i < images.length; i += 2)
              if (!Arrays.equals(model.predict(images[i]).logits, alone[i])) wrong.incrementAndGet();
        });
        threads[t].start();
      }
      for (Thread thread : threads) thread.join();
      check(wrong.get() == 0, wrong.get() + " answers were not their image's own");
    }
    try {
      MobileMoe.open(bundle, new MobileMoe.Options().threads(5000)).close();
      check(false, "threads 5000 was not refused");
    } catch (MobileMoeException refused) {
      check(refused.status() == MobileMoeException.Status.BAD_ARGUMENT, "status " + refused.status());
      check(refused.getMessage().contains("options.threads 5000 is out of range"), refused.getMessage());
    }
    MobileMoe closed = MobileMoe.open(bundle, noCache);
    float[] image = new float[closed.inputValues()];
    closed.close();
    try {
      closed.predict(image);
      check(false, "a call after close was not refused");
    } catch (IllegalStateException expected) {
      // refused, as Java's close promises
    }
    System.out.println("JavaBindingTest: ok");
  }
}
