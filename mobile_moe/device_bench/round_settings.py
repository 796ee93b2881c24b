"""One run's knobs, shared by every runner (native, Python worker, adb, Core ML)."""

from __future__ import annotations

from dataclasses import dataclass

from mobile_moe.errors import UsageError

# The most inference threads a round may ask for: the native runner's own bound (runner.cpp, --threads). Unbounded,
# `--threads 100000` on an ONNX bundle had onnxruntime start that many threads and exhaust the machine's processes.
MAX_THREADS = 1024
# The most iterations, warm-up runs or switch repeats a round may ask for: the native runner's own bound (runner.cpp,
# kMaxFlag). Unbounded, `--iterations 99999999999999999999` had a runtime worker run until it was killed.
MAX_COUNT = 1_000_000


@dataclass(frozen=True)
class RoundSettings:
    iterations: int = 50  # timed end-to-end runs after warm-up
    warmup: int = 5
    threads: int = 1
    cache_experts: int | None = None  # expert graphs kept loaded; None: all of them
    cache_margin: float = 0.0  # cache-aware routing (mobile_moe.expert_choice.pick_experts); 0: plain top-k
    # Native runner: experts evicted beyond cache_experts that keep their initialised methods, their weights' pages
    # dropped, so a switch back skips the load (graphs.h ExpertCache); None: every one; 0: evicted experts unload.
    park_experts: int | None = None
    switch_repeats: int = 2  # times each expert's switch (unload, load, first run) is measured
    # Native runner: XNNPACK's packed weights cached on disk, one checked file per graph, in the user's cache folder
    # (mobile_moe.cache.packed_weights_dir), so a graph packed by one run is mapped by the next, as on an app's second
    # launch; False packs every load on the heap.
    weight_cache: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.iterations <= MAX_COUNT:
            raise UsageError(f"--iterations {self.iterations}: must be from 1 (percentiles need one) to {MAX_COUNT}")
        if not 0 <= self.warmup <= MAX_COUNT:
            raise UsageError(f"--warmup {self.warmup}: must be from 0 to {MAX_COUNT}")
        if not 1 <= self.threads <= MAX_THREADS:
            raise UsageError(f"--threads {self.threads}: must be between 1 and {MAX_THREADS}")
        if self.cache_experts is not None and self.cache_experts < 1:
            raise UsageError(f"--cache-experts {self.cache_experts}: must be at least 1")
        if self.park_experts is not None and self.park_experts < 0:
            raise UsageError(f"--park-experts {self.park_experts}: must be 0 (evicted experts unload) or more")
        if not 0.0 <= self.cache_margin <= 1.0:
            raise UsageError(f"--cache-margin {self.cache_margin}: a gate margin between 0 and 1")
        if not 0 <= self.switch_repeats <= MAX_COUNT:
            repeats = self.switch_repeats
            raise UsageError(f"--switch-repeats {repeats}: must be from 0 (no switch timing) to {MAX_COUNT}")

    def runner_flags(self) -> list[str]:
        """The command-line flags every runner takes for these settings (the native runner's own: runner_command)."""
        flags = ["--iterations", str(self.iterations), "--warmup", str(self.warmup), "--threads", str(self.threads)]
        flags += ["--switch-repeats", str(self.switch_repeats)]
        if self.cache_experts is not None:
            flags += ["--cache-experts", str(self.cache_experts)]
        if self.cache_margin:
            flags += ["--cache-margin", repr(self.cache_margin)]
        return flags
