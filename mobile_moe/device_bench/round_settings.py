"""One run's knobs, shared by every runner (native, Python worker, adb, Core ML)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mobile_moe.errors import UsageError
from mobile_moe.library.options import OPTION, OPTIONS, checked, runner_flags

# The most iterations, warm-up runs or switch repeats a round may ask for: the native runner's own bound (runner.cpp,
# kMaxFlag). Unbounded, `--iterations 99999999999999999999` had a runtime worker run until it was killed.
MAX_COUNT = 1_000_000


@dataclass(frozen=True)
class RoundSettings:
    """What one round measures, and with which of libmobile_moe's options (mobile_moe.library.options: the same names,
    encodings, defaults and bounds as mm_options, so a round left at its defaults runs what an app's defaults give)."""

    iterations: int = 50  # timed end-to-end runs after warm-up
    warmup: int = 5
    switch_repeats: int = 2  # times each expert's switch (unload, load, first run) is measured
    threads: int = OPTION["threads"].default
    cache_experts: int = OPTION["cache_experts"].default
    park_experts: int = OPTION["park_experts"].default
    cache_margin: float = OPTION["cache_margin"].default
    weight_cache_dir: str | None = OPTION["weight_cache_dir"].default
    weight_cache_limit_mib: int = OPTION["weight_cache_limit_mib"].default
    prefetch: int = OPTION["prefetch"].default

    def __post_init__(self) -> None:
        if not 1 <= self.iterations <= MAX_COUNT:
            raise UsageError(f"--iterations {self.iterations}: must be from 1 (percentiles need one) to {MAX_COUNT}")
        if not 0 <= self.warmup <= MAX_COUNT:
            raise UsageError(f"--warmup {self.warmup}: must be from 0 to {MAX_COUNT}")
        if not 0 <= self.switch_repeats <= MAX_COUNT:
            repeats = self.switch_repeats
            raise UsageError(f"--switch-repeats {repeats}: must be from 0 (no switch timing) to {MAX_COUNT}")
        checked(self.library_options())

    def library_options(self) -> dict[str, Any]:
        """The round's libmobile_moe options, by name."""
        return {option.name: getattr(self, option.name) for option in OPTIONS}

    def runner_flags(self) -> list[str]:
        """The command-line flags every runner takes for these settings (the native runner's own: runner_command):
        the library's options only where they differ from its defaults."""
        flags = ["--iterations", str(self.iterations), "--warmup", str(self.warmup)]
        flags += ["--switch-repeats", str(self.switch_repeats)]
        return flags + runner_flags(self.library_options())
