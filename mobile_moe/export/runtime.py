"""A bundle ready to predict, whatever its backend: `load_bundle(path, **options)`.

    bundle = load_bundle("bundle/", cache_experts=2)  # libmobile_moe's options by name (mobile_moe/library/options.py)
    prediction = bundle.predict(image)       # image: float32 (3, S, S) or (1, 3, S, S), already normalised
    prediction.logits, prediction.experts, prediction.gates, prediction.timings
    bundle.loaded_graphs                     # e.g. ["router", "expert_3"]

An ExecuTorch bundle runs in libmobile_moe (mobile_moe.library.binding: LibraryBundle), the library an app links, so
what Python answers is what an app answers. ONNX and Core ML bundles, and a split's eager modules (export's parity
off macOS), run in BundleRuntime, this module's Python composition of one loaded graph per manifest entry: the router
at open, an expert only when an image first picks it, at most `cache_experts` experts (-1 the bundle's top_k, 0 every
one, as libmobile_moe's option means it), the least recently used going first. Every graph's sha256 is checked before
a backend parses it; the manifest's composition says how graphs combine.

A whole bundle (a per-token MoE: vmoe, experts-choice, soft-moe, widenet) is one graph, loaded at open, that reports
how many token slots each expert of each expert set (MoE block) filled for the image (`expert_tokens`, (1, G, E)).
Its Prediction's `experts` are the experts the image used in any set (slots summed over the sets > 0), ascending, and
`gates` each one's share of the image's token slots (they sum to 1): there is no single gate per image to report, and
the share says how much of the image each expert saw.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mobile_moe.errors import UsageError
from mobile_moe.export.bundle_routing import pick_experts, used_experts
from mobile_moe.export.images import load_image
from mobile_moe.export.loaded_graphs import GRAPH_OF_BACKEND
from mobile_moe.export.manifest import bundle_identity, read_manifest, same_bundle, verified_graph_files
from mobile_moe.export.manifest_schema import GraphEntry, Manifest
from mobile_moe.export.quiet import native_stderr_captured
from mobile_moe.library import options as library_options
from mobile_moe.library.binding import Model, Prediction, read_rgb

LoadedGraph = Callable[[list[np.ndarray]], dict[str, np.ndarray]]


def _milliseconds(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


class BundleRuntime:
    def __init__(
        self,
        path: str | os.PathLike,
        cache_experts: int = library_options.OPTION["cache_experts"].default,
        threads: int = library_options.OPTION["threads"].default,
        open_graph: Callable[[GraphEntry], LoadedGraph] | None = None,
        cache_margin: float = library_options.OPTION["cache_margin"].default,
    ):
        library_options.checked({"cache_experts": cache_experts, "threads": threads, "cache_margin": cache_margin})
        self.cache_margin = cache_margin
        self.path = Path(path)
        self._identity = bundle_identity(self.path)  # before the manifest: what a later load must still find there
        self.manifest = read_manifest(self.path)
        self.backend = self.manifest.backend
        top_k = max(self.manifest.top_k or 1, 1)
        if 0 < cache_experts < top_k and self.manifest.kind == "split":
            raise UsageError(f"--cache-experts {cache_experts} is fewer than the bundle's top_k, {top_k}: an image's "
                             f"experts run together; cache at least {top_k}")  # fmt: skip
        # libmobile_moe's encoding: -1 the bundle's top_k, 0 every expert (no bound), N
        self.max_cached_experts = top_k if cache_experts == -1 else None if cache_experts == 0 else cache_experts
        self.threads = threads or None  # 0: the runtime's own default
        self._open_graph = open_graph or self._open_file
        self._graphs = {graph.name: graph for graph in self.manifest.graphs}
        self.composition = self.manifest.composition
        self.layout = self.composition.layout
        # Graphs loaded at open: router, shared block parts, head, whole model.
        self._resident: dict[str, LoadedGraph] = {}
        self._experts: OrderedDict[int, dict[str, LoadedGraph]] = OrderedDict()  # expert -> its graphs, LRU order
        for name in resident_graph_names(self.manifest):
            self._resident[name] = self._open_graph(self._graphs[name])

    # --- loading ------------------------------------------------------------------------------------------------------

    def _open_file(self, graph: GraphEntry) -> LoadedGraph:
        """The graph's files verified against the manifest read at open, then loaded (by path, again). An expert loads
        when first chosen, so an export may have replaced the bundle since, or between the check and the load: the
        folder must still be the one whose manifest was read, or that is the one line, whatever the swap broke."""
        with same_bundle(self.path, self._identity):
            path, *weights = verified_graph_files(self.path, graph)
            if self.backend not in GRAPH_OF_BACKEND:
                raise UsageError(f"{self.path} is an {self.backend} bundle: libmobile_moe runs those (load_bundle)")
            return GRAPH_OF_BACKEND[self.backend](path, graph, self.threads, *weights)

    def _expert_graph_names(self, expert: int) -> list[str]:
        if self.layout == "per-block":
            return [block.experts[expert] for block in self.composition.blocks]
        return [self.composition.experts[expert]]

    def _expert(self, expert: int) -> tuple[dict[str, LoadedGraph], float]:
        """Expert `expert`'s graphs (loading them if needed, evicting the LRU expert) and the load time in ms."""
        if expert in self._experts:
            self._experts.move_to_end(expert)
            return self._experts[expert], 0.0
        start = time.perf_counter()
        graphs = {name: self._open_graph(self._graphs[name]) for name in self._expert_graph_names(expert)}
        self._experts[expert] = graphs
        while self.max_cached_experts is not None and len(self._experts) > self.max_cached_experts:
            self._experts.popitem(last=False)  # dropping the graph frees the program and its packed weights
        return graphs, _milliseconds(start)

    @property
    def loaded_graphs(self) -> list[str]:
        return [*self._resident, *(name for graphs in self._experts.values() for name in graphs)]

    @property
    def loaded_experts(self) -> list[int]:
        """Loaded experts, least recently used first."""
        return list(self._experts)

    @property
    def experts_kept(self) -> int:
        """The expert graph sets kept loaded, as cache_experts resolved (0: a bundle of one graph)."""
        if self.layout in ("dense", "monolithic", "whole"):
            return 0
        return self.max_cached_experts or self.manifest.num_experts

    # --- prediction ---------------------------------------------------------------------------------------------------

    def _image_batch(self, image: Any) -> np.ndarray:
        shape = tuple(self.manifest.input.shape)  # (1, C, S, S)
        array = image.detach().cpu().numpy() if hasattr(image, "detach") else image
        if not isinstance(array, np.ndarray):
            raise UsageError(f"image must be a numpy array or torch tensor, got {type(image).__name__}")
        if array.dtype != np.float32:
            raise UsageError(f"image dtype {array.dtype}: the bundle takes float32 (normalised with its mean/std)")
        if array.shape == shape[1:]:
            array = array[None]
        if array.shape != shape:
            raise UsageError(f"image shape {tuple(array.shape)}: the bundle takes {shape[1:]} or {shape}")
        return np.ascontiguousarray(array)

    def choose_experts(self, router_probs: np.ndarray) -> tuple[list[int], list[float]]:
        """bundle_routing.pick_experts on the router's probabilities, with the model's k and renormalisation and the
        experts loaded now as the resident ones."""
        try:
            return pick_experts(
                router_probs,
                k=self.manifest.top_k,
                renormalize=bool(self.manifest.model.renormalize_gates),
                resident=set(self._experts),
                margin=self.cache_margin,
            )
        except ValueError as error:  # a corrupt graph's output
            raise UsageError(f"{self.path}: {error}; re-export the bundle") from None

    def used_experts(self, expert_tokens: np.ndarray) -> tuple[list[int], list[float]]:
        """bundle_routing.used_experts on a whole graph's expert_tokens."""
        try:
            return used_experts(expert_tokens)
        except ValueError as error:  # a corrupt graph's output
            raise UsageError(f"{self.path}: {error}; re-export the bundle") from None

    def read_image(self, path: str | os.PathLike) -> Any:
        """An image file as predict takes it: preprocessed by the manifest's `input` (as evaluate fed the run its
        images)."""
        return load_image(path, self.manifest.input)

    def predict_file(self, path: str | os.PathLike) -> Prediction:
        return self.predict(self.read_image(path))

    def predict(self, image: Any) -> Prediction:
        batch = self._image_batch(image)
        start = time.perf_counter()
        if self.layout in ("dense", "monolithic", "whole"):
            return self._predict_single(batch, start)
        routed = self._resident[self.composition.router]([batch])
        experts, gates = self.choose_experts(routed["router_probs"])
        tokens = routed["tokens"]
        if self.composition.trunk_tail is not None:  # early routing: the trunk's last dense blocks
            tokens = self._resident[self.composition.trunk_tail]([tokens])["tokens"]
        router_ms = _milliseconds(start)
        load_ms = 0.0
        hit = all(expert in self._experts for expert in experts)
        loaded = []
        for expert in experts:
            graphs, ms = self._expert(expert)
            loaded.append(graphs)
            load_ms += ms
        compute = time.perf_counter()
        if self.layout == "per-block":
            logits = self._run_blocks(tokens, loaded, gates)
        else:
            gate = np.asarray([[gates[0]]], dtype=np.float32)  # (1, 1)
            logits = next(iter(loaded[0].values()))([tokens, gate])["logits"]
        timings = {
            "router": router_ms,
            "load": load_ms,
            "experts": _milliseconds(compute),
            "total": _milliseconds(start),
        }
        return Prediction(logits[0], experts, gates, timings, hit)

    def _predict_single(self, batch: np.ndarray, start: float) -> Prediction:
        """One graph: no experts (dense), top-k of its router_probs (monolithic), or the experts it used (whole)."""
        out = next(iter(self._resident.values()))([batch])
        experts, gates = [], []
        if self.layout == "monolithic":
            experts, gates = self.choose_experts(out["router_probs"])
        elif self.layout == "whole":
            experts, gates = self.used_experts(out["expert_tokens"])
        total = _milliseconds(start)
        return Prediction(
            out["logits"][0], experts, gates, {"router": 0.0, "load": 0.0, "experts": 0.0, "total": total}
        )

    def _run_blocks(self, tokens: np.ndarray, experts: list[dict[str, LoadedGraph]], gates: list[float]) -> np.ndarray:
        """tokens = residual + sum_j gate_j * delta_j in every MoE block, then the head (the manifest's `combine`)."""
        x = tokens  # (1, T, D)
        for block in self.composition.blocks:
            shared = self._resident[block.shared]([x])
            x = shared["residual"].copy()
            for graphs, gate in zip(experts, gates, strict=True):
                name = next(name for name in graphs if name in block.experts)
                x += np.float32(gate) * graphs[name]([shared["normed"]])["delta"]
        return self._resident[self.composition.head]([x])["logits"]


def resident_graph_names(manifest: Manifest) -> list[str]:
    """The graphs a bundle loads at open: the router (and trunk tail, and a per-block split's shared parts and head),
    or a dense, monolithic or whole bundle's one graph."""
    composition = manifest.composition
    if composition.layout in ("dense", "monolithic", "whole"):
        return [manifest.graphs[0].name]
    names = [composition.router]
    if composition.trunk_tail is not None:
        names.append(composition.trunk_tail)
    if composition.layout == "per-block":
        names += [block.shared for block in composition.blocks] + [composition.head]
    return names


class LibraryBundle:
    """An ExecuTorch bundle run by libmobile_moe (mobile_moe.library.binding.Model), with BundleRuntime's interface:
    the answers, routing and loads are the library's own."""

    def __init__(self, path: str | os.PathLike, manifest: Manifest, **options: Any):
        self.path, self.manifest = Path(path), manifest
        self.backend, self.composition = manifest.backend, manifest.composition
        self.layout = manifest.composition.layout
        # In a process that has loaded ExecuTorch's Python runtime too (export's), the library's first open hands
        # ExecuTorch's log to the library, and ExecuTorch says on fd 2 that its log was handed over twice.
        with native_stderr_captured():
            self.model = Model(path, **options)
        self._expert_of_graph = {graph.name: graph.expert for graph in manifest.graphs if graph.expert is not None}

    def predict(self, image: Any) -> Prediction:
        """`image`: float32 (C, S, S) or (1, C, S, S), preprocessed; or (H, W, 3) uint8 RGB pixels (read_image's),
        which the library preprocesses as the manifest says, as it does an app's."""
        if getattr(image, "dtype", None) == np.uint8:
            return self.model.predict_rgb(image)
        return self.model.predict(image)

    def read_image(self, path: str | os.PathLike) -> np.ndarray:
        """An image file as an app has it: decoded, upright, 8-bit RGB (mobile_moe/data/image_files.py)."""
        return read_rgb(path)

    def predict_file(self, path: str | os.PathLike) -> Prediction:
        return self.predict(self.read_image(path))

    @property
    def loaded_graphs(self) -> list[str]:
        """The resident graphs, then the loaded experts' graphs, least recently used first."""
        return [*resident_graph_names(self.manifest), *reversed(self.model.loaded_expert_graphs())]

    @property
    def loaded_experts(self) -> list[int]:
        """Loaded experts, least recently used first."""
        experts = (self._expert_of_graph.get(name) for name in reversed(self.model.loaded_expert_graphs()))
        return list(dict.fromkeys(expert for expert in experts if expert is not None))

    @property
    def experts_kept(self) -> int:
        """The expert graph sets kept loaded, as the library resolved cache_experts (0: a bundle of one graph)."""
        return self.model.info["cache_experts"]

    def close(self) -> None:
        self.model.close()


def load_bundle(path: str | os.PathLike, **options: Any) -> BundleRuntime | LibraryBundle:
    """A bundle ready to predict, with libmobile_moe's `options` by name (mobile_moe/library/options.py; those left
    out keep the library's defaults): an ExecuTorch bundle in the library; an ONNX or Core ML one in BundleRuntime,
    which takes threads, cache_experts and cache_margin (refusing the library's other options)."""
    manifest = read_manifest(path)
    if manifest.backend == "executorch":
        return LibraryBundle(path, manifest, **options)
    others = library_options.library_only(options)
    if others:
        raise UsageError(f"{library_options.OPTION[others[0]].flag} is libmobile_moe's; {path} is a "
                         f"{manifest.backend} bundle, run in Python: leave it out")  # fmt: skip
    return BundleRuntime(path, **{name: options[name] for name in library_options.EVERY_RUNTIME if name in options})
