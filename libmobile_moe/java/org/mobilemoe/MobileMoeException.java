package org.mobilemoe;

/**
 * A failure of libmobile_moe: the C API's status and its one-line message (mm_last_error), which names the call, what
 * was wrong and how to fix it. ExecuTorch's Android Module throws ExecutorchRuntimeException the same way.
 */
public final class MobileMoeException extends RuntimeException {
  /** mobile_moe.h's mm_status, by name. */
  public enum Status {
    BAD_ARGUMENT(1),
    BAD_BUNDLE(2),
    RUNTIME_ERROR(3),
    OUT_OF_MEMORY(4);

    public final int code;

    Status(int code) {
      this.code = code;
    }

    static Status of(int code) {
      for (Status status : values()) if (status.code == code) return status;
      return RUNTIME_ERROR;
    }
  }

  private final Status status;

  MobileMoeException(int code, String message) {
    super(message);
    this.status = Status.of(code);
  }

  public Status status() {
    return status;
  }
}
