"""Core ML measurement (macOS only): export's runtime opens the bundle's Core ML graphs in the Python worker.

Off macOS Core ML cannot run a model at all, so this refuses with a clear error rather than reporting nothing.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

from mobile_moe.device_bench.python_worker import PythonWorker
from mobile_moe.device_bench.round_report import RoundJson
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.errors import UsageError
from mobile_moe.export.loaded_graphs import coreml_runs_here


def require_macos() -> None:
    if not coreml_runs_here():
        raise UsageError(
            f"--runtime coreml runs Core ML models, which only macOS/iOS can execute (this is {platform.system()}); "
            "benchmark a Core ML bundle on a Mac, or use --runtime executorch|onnxruntime|native here"
        )


@dataclass(frozen=True)
class CoreMLWorker:
    """The Python worker with runtime coreml; refused at construction anywhere but macOS."""

    def __post_init__(self) -> None:
        require_macos()

    @property
    def name(self) -> str:
        return "coreml worker"

    def run_round(self, bundle: Path, images: Path, settings: RoundSettings) -> RoundJson:
        return PythonWorker("coreml").run_round(bundle, images, settings)
