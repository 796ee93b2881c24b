"""Core ML measurement (macOS only): coremltools MLModel with compute units CPU_ONLY / CPU_AND_NE / ALL.

Off macOS Core ML cannot run a model at all, so this refuses with a clear error rather than reporting nothing.
"""

from __future__ import annotations

import platform

from mobile_moe.errors import UsageError

COMPUTE_UNITS = ("CPU_ONLY", "CPU_AND_NE", "ALL")


def require_macos() -> None:
    if platform.system() != "Darwin":
        raise UsageError(
            f"--runtime coreml runs Core ML models, which only macOS/iOS can execute (this is {platform.system()}); "
            "benchmark a Core ML bundle on a Mac, or use --runtime executorch|onnxruntime|native here"
        )


def worker_command(python: str, bundle: str, images: str, settings, compute_units: str = "ALL") -> list[str]:
    """The Python worker, with export's runtime opening Core ML graphs at the chosen compute units."""
    require_macos()
    if compute_units not in COMPUTE_UNITS:
        raise UsageError(f"compute units {compute_units!r}: choose one of {', '.join(COMPUTE_UNITS)}")
    command = [python, "-m", "device_bench.python_worker", "--bundle", bundle, "--runtime", "coreml"]
    command += ["--input", images, "--iterations", str(settings.iterations), "--warmup", str(settings.warmup)]
    return command + ["--threads", str(settings.threads), "--compute-units", compute_units]
