"""One loaded graph per backend, behind one call: `runner(list of numpy inputs) -> {output name: numpy array}`.

Inputs and outputs follow the manifest's order and names. ExecuTorch methods take positional tensors; ONNX Runtime
feeds by name; Core ML (macOS only) by name too. The torch runner runs a split module in PyTorch: the bundle builder
uses it to check the split and composition where the backend itself cannot run here (Core ML off macOS).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from mobile_moe.errors import UsageError


class ExecuTorchRunner:
    def __init__(self, path: Path, graph: dict[str, Any], threads: int | None = None):
        from executorch.runtime import Runtime

        self.output_names = [spec["name"] for spec in graph["outputs"]]
        self.program = Runtime.get().load_program(str(path))
        self.method = self.program.load_method("forward")  # initialises the XNNPACK delegate (packs weights)

    def __call__(self, inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        outputs = self.method.execute([torch.from_numpy(np.ascontiguousarray(x)) for x in inputs])
        return {name: out.numpy() for name, out in zip(self.output_names, outputs, strict=True)}


class OnnxRunner:
    def __init__(self, path: Path, graph: dict[str, Any], threads: int | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.log_severity_level = 3
        self.input_names = [spec["name"] for spec in graph["inputs"]]
        self.output_names = [spec["name"] for spec in graph["outputs"]]
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def __call__(self, inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.session.run(self.output_names, dict(zip(self.input_names, inputs, strict=True)))
        return dict(zip(self.output_names, outputs, strict=True))


class CoreMLRunner:
    def __init__(self, path: Path, graph: dict[str, Any], threads: int | None = None):
        if sys.platform != "darwin":
            raise UsageError(
                "Core ML bundles run only on macOS (Core ML is an Apple framework); here, export with "
                "--format executorch or onnx, or run this bundle on a Mac"
            )
        import coremltools as ct

        self.input_names = [spec["name"] for spec in graph["inputs"]]
        self.output_names = [spec["name"] for spec in graph["outputs"]]
        self.model = ct.models.MLModel(str(path))

    def __call__(self, inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.model.predict(dict(zip(self.input_names, inputs, strict=True)))
        return {name: np.asarray(outputs[name], dtype=np.float32) for name in self.output_names}


class TorchRunner:
    """A split module run in PyTorch (no file): for checking a split where its backend cannot run."""

    def __init__(self, module, graph: dict[str, Any]):
        self.module = module.eval()
        self.output_names = [spec["name"] for spec in graph["outputs"]]

    def __call__(self, inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        with torch.no_grad():
            outputs = self.module(*(torch.from_numpy(x) for x in inputs))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return {name: out.numpy() for name, out in zip(self.output_names, outputs, strict=True)}


RUNNERS = {"executorch": ExecuTorchRunner, "onnx": OnnxRunner, "coreml": CoreMLRunner}
