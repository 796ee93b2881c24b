"""One ExecuTorch graph file run alone through ExecuTorch's Python runtime: for tests that look at a single graph of a
bundle (an expert of a shared-weights family, a program whose flatbuffer was changed), which libmobile_moe only runs
as part of a bundle. The toolkit runs bundles through libmobile_moe (mobile_moe/library/binding.py), never this."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mobile_moe.export.loaded_graphs import bundle_fault, check_shapes, named_outputs, native_path
from mobile_moe.export.manifest_schema import GraphEntry
from mobile_moe.export.quiet import native_stderr_captured


class ExecuTorchGraph:
    def __init__(self, path: Path, graph: GraphEntry, threads: int | None = None, weights: Path | None = None):
        """`weights`: the .ptd holding the weights this graph keeps outside its program (shared by a family)."""
        from executorch.runtime import Runtime, Verification

        self.graph = graph
        try:
            with native_stderr_captured(), native_path(path) as program, native_path(weights) as data_path:
                runtime = Runtime.get()
                self.program = runtime.load_program(
                    program, verification=Verification.InternalConsistency, data_path=data_path
                )
                self.method = self.program.load_method("forward")  # initialises XNNPACK (packs weights)
            meta = self.method.metadata
            inputs = [tuple(meta.input_tensor_meta(i).sizes()) for i in range(meta.num_inputs())]
            outputs = [tuple(meta.output_tensor_meta(i).sizes()) for i in range(meta.num_outputs())]
        except (RuntimeError, ValueError) as error:
            raise bundle_fault(graph, f"ExecuTorch cannot load it ({error})") from None
        check_shapes(graph, "inputs", inputs)
        check_shapes(graph, "outputs", outputs)

    def __call__(self, inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        try:
            with native_stderr_captured():  # a failing delegate logs its own line to fd 2; ours is the one line
                outputs = self.method.execute([torch.from_numpy(np.ascontiguousarray(x)) for x in inputs])
        except (RuntimeError, ValueError) as error:
            raise bundle_fault(self.graph, f"ExecuTorch failed to run it ({error})") from None
        return named_outputs(self.graph, [out.numpy() for out in outputs])


