"""One loaded graph per backend, behind one call: `graph(list of numpy inputs) -> {output name: numpy array}`.

(A loaded graph, as graph_loader.h's LoadedGraph is in libmobile_moe; "runner" names what runs a benchmark round.)
Inputs and outputs follow the manifest's order and names. ONNX Runtime feeds by name; Core ML (macOS only) by name
too. TorchGraph runs a split module in PyTorch: the bundle builder uses it to check the split and composition where
the backend itself cannot run here (Core ML off macOS). ExecuTorch bundles are not here: libmobile_moe runs them
(mobile_moe/library/binding.py), as it does in an app.

A graph file is loaded only after its sha256 matched the manifest, but a file can be re-sealed after tampering: so
each loaded graph also checks the program's own input and output shapes against the manifest when it loads
it, and the shapes of what it returns, and reports any backend failure as the bundle's fault (UsageError, one line),
never as a traceback.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mobile_moe.errors import UsageError
from mobile_moe.export.manifest_schema import GraphEntry


def coreml_runs_here() -> bool:
    """Whether Core ML can run a model on this machine: only Apple's systems have the framework."""
    return platform.system() == "Darwin"


def bundle_fault(graph: GraphEntry, what: str) -> UsageError:
    """The one-line error for a graph file that its backend rejects or that disagrees with the manifest."""
    what = (str(what).strip().splitlines() or ["no detail"])[0][:200]
    return UsageError(f"graph {graph.name!r} ({graph.file}): {what}; the bundle is corrupt: re-export it")


def check_shapes(graph: GraphEntry, kind: str, shapes: list[tuple[int, ...]]) -> None:
    """`shapes` (the program's or its results') must be the manifest's `kind` ("inputs" / "outputs") specs."""
    expected = [tuple(spec.shape) for spec in getattr(graph, kind)]
    # A symbolic dimension ("batch", None: ONNX Runtime reports those) is not a fixed size: it never matches.
    if [tuple(d if isinstance(d, int) else str(d) for d in shape) for shape in shapes] != expected:
        raise bundle_fault(graph, f"its {kind} have shapes {shapes}, the manifest says {expected}")


def named_outputs(graph: GraphEntry, outputs: list[np.ndarray]) -> dict[str, np.ndarray]:
    check_shapes(graph, "outputs", [tuple(out.shape) for out in outputs])
    return {spec.name: out for spec, out in zip(graph.outputs, outputs, strict=True)}


@contextlib.contextmanager
def native_path(path: str | os.PathLike | None) -> Iterator[str | None]:
    """`path` as a str that a native library can open: pybind11 passes a str on as UTF-8, which a name whose bytes
    are not UTF-8 (Python holds them as surrogate escapes) cannot be. Such a file is opened here and named by its
    descriptor (/dev/fd/N, Linux and macOS) while the library opens it."""
    if path is None or _is_utf8(os.fsencode(path)):
        yield None if path is None else str(path)
        return
    handle = os.open(path, os.O_RDONLY)
    try:
        yield f"/dev/fd/{handle}"
    finally:
        os.close(handle)


def _is_utf8(name: bytes) -> bool:
    try:
        name.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _onnxruntime_errors() -> tuple[type[BaseException], ...]:
    """ONNX Runtime's exceptions derive from Exception alone, one class per status code: take them all."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    statuses = [value for value in vars(state).values() if isinstance(value, type) and issubclass(value, Exception)]
    return (RuntimeError, ValueError, *statuses)


class OnnxGraph:
    def __init__(self, path: Path, graph: GraphEntry, threads: int | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.log_severity_level = 3
        self.graph = graph
        self.input_names = [spec.name for spec in graph.inputs]
        self.output_names = [spec.name for spec in graph.outputs]
        try:
            with native_path(path) as model:
                self.session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        except _onnxruntime_errors() as error:
            raise bundle_fault(graph, f"ONNX Runtime cannot load it ({error})") from None
        declared = {node.name: node.shape for node in self.session.get_inputs()}
        if sorted(declared) != sorted(self.input_names):
            raise bundle_fault(graph, f"its inputs are {sorted(declared)}, the manifest says {self.input_names}")
        check_shapes(graph, "inputs", [tuple(declared[name]) for name in self.input_names])

    def __call__(self, inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
        try:
            outputs = self.session.run(self.output_names, dict(zip(self.input_names, inputs, strict=True)))
        except _onnxruntime_errors() as error:
            raise bundle_fault(self.graph, f"ONNX Runtime failed to run it ({error})") from None
        return named_outputs(self.graph, outputs)


class CoreMLGraph:
    def __init__(self, path: Path, graph: GraphEntry, threads: int | None = None):
        if not coreml_runs_here():
            raise UsageError(
                "Core ML bundles run only on macOS (Core ML is an Apple framework); here, export with "
                "--format executorch or onnx, or run this bundle on a Mac"
            )
        import coremltools as ct

        self.graph = graph
        self.input_names = [spec.name for spec in graph.inputs]
        self.output_names = [spec.name for spec in graph.outputs]
        try:  # coremltools reports a bad package with several exception types; untested here (macOS only)
            self.model = ct.models.MLModel(str(path))
        except (RuntimeError, ValueError, OSError, KeyError) as error:
            raise bundle_fault(graph, f"Core ML cannot load it ({error})") from None

    def __call__(self, inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
        try:
            outputs = self.model.predict(dict(zip(self.input_names, inputs, strict=True)))
            results = [np.asarray(outputs[name], dtype=np.float32) for name in self.output_names]
        except (RuntimeError, ValueError, KeyError) as error:
            raise bundle_fault(self.graph, f"Core ML failed to run it ({error})") from None
        return named_outputs(self.graph, results)


class TorchGraph:
    """A split module run in PyTorch (no file): for checking a split where its backend cannot run."""

    def __init__(self, module, graph: GraphEntry):
        self.module = module.eval()
        self.output_names = [spec.name for spec in graph.outputs]

    def __call__(self, inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        with torch.no_grad():
            outputs = self.module(*(torch.from_numpy(x) for x in inputs))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return {name: out.numpy() for name, out in zip(self.output_names, outputs, strict=True)}


GRAPH_OF_BACKEND = {"onnx": OnnxGraph, "coreml": CoreMLGraph}  # ExecuTorch bundles run in libmobile_moe
