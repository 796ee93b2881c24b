"""The Python bundle runtime: load the router at open, an expert only when an image first picks it, and keep at most
`max_cached_experts` experts loaded (least recently used goes first).

    bundle = load_bundle("bundle/", max_cached_experts=2)
    prediction = bundle.predict(image)       # image: float32 (3, S, S) or (1, 3, S, S), already normalised
    prediction.logits, prediction.experts, prediction.gates, prediction.timings
    bundle.loaded_graphs                     # e.g. ["router", "expert_3"]

Every graph's sha256 is checked before a backend parses it; the manifest's composition says how graphs combine.

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
from typing import Any, NamedTuple

import numpy as np

from mobile_moe.errors import UsageError
from mobile_moe.expert_choice import pick_experts, used_experts
from mobile_moe.export.images import load_image
from mobile_moe.export.loaded_graphs import GRAPH_OF_BACKEND
from mobile_moe.export.manifest import bundle_identity, read_manifest, same_bundle, verified_graph_files
from mobile_moe.export.manifest_schema import GraphEntry

LoadedGraph = Callable[[list[np.ndarray]], dict[str, np.ndarray]]


class Prediction(NamedTuple):
    logits: np.ndarray  # (K,)
    experts: list[int]  # chosen experts, highest gate first; used experts, ascending (whole); [] for a dense bundle
    gates: list[float]  # their weights; for a whole bundle, each one's share of the image's token slots
    timings: dict[str, float]  # milliseconds: router, load (experts loaded for this image), experts, total


def _milliseconds(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


class BundleRuntime:
    def __init__(
        self,
        path: str | os.PathLike,
        max_cached_experts: int | None = None,
        threads: int | None = None,
        open_graph: Callable[[GraphEntry], LoadedGraph] | None = None,
        cache_margin: float = 0.0,
    ):
        if max_cached_experts is not None and max_cached_experts < 1:
            raise UsageError(f"--cache-experts {max_cached_experts}: keep at least 1 expert loaded (or leave it out)")
        if not 0.0 <= cache_margin <= 1.0:
            raise UsageError(f"--cache-margin {cache_margin}: a gate margin between 0 and 1")
        self.cache_margin = cache_margin
        self.path = Path(path)
        self._identity = bundle_identity(self.path)  # before the manifest: what a later load must still find there
        self.manifest = read_manifest(self.path)
        self.backend = self.manifest.backend
        self.max_cached_experts = max_cached_experts
        self.threads = threads
        self._open_graph = open_graph or self._open_file
        self._graphs = {graph.name: graph for graph in self.manifest.graphs}
        self.composition = self.manifest.composition
        self.layout = self.composition.layout
        # Graphs loaded at open: router, shared block parts, head, whole model.
        self._resident: dict[str, LoadedGraph] = {}
        self._experts: OrderedDict[int, dict[str, LoadedGraph]] = OrderedDict()  # expert -> its graphs, LRU order
        for name in self._resident_graph_names():
            self._resident[name] = self._open_graph(self._graphs[name])

    # --- loading ------------------------------------------------------------------------------------------------------

    def _open_file(self, graph: GraphEntry) -> LoadedGraph:
        """The graph's files verified against the manifest read at open, then loaded (by path, again). An expert loads
        when first chosen, so an export may have replaced the bundle since, or between the check and the load: the
        folder must still be the one whose manifest was read, or that is the one line, whatever the swap broke."""
        with same_bundle(self.path, self._identity):
            path, *weights = verified_graph_files(self.path, graph)
            return GRAPH_OF_BACKEND[self.backend](path, graph, self.threads, *weights)

    def _resident_graph_names(self) -> list[str]:
        if self.layout in ("dense", "monolithic", "whole"):
            return [self.manifest.graphs[0].name]
        names = [self.composition.router]
        if self.composition.trunk_tail is not None:
            names.append(self.composition.trunk_tail)
        if self.layout == "per-block":
            names += [block.shared for block in self.composition.blocks] + [self.composition.head]
        return names

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
        """expert_choice.pick_experts on the router's probabilities, with the model's k and renormalisation and the
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
        """expert_choice.used_experts on a whole graph's expert_tokens."""
        try:
            return used_experts(expert_tokens)
        except ValueError as error:  # a corrupt graph's output
            raise UsageError(f"{self.path}: {error}; re-export the bundle") from None

    def predict_file(self, path: str | os.PathLike) -> Prediction:
        """One PNG or JPEG file, preprocessed by the manifest's `input` (as evaluate fed the run its images)."""
        return self.predict(load_image(path, self.manifest.input))

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
        return Prediction(logits[0], experts, gates, timings)

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


def load_bundle(
    path: str | os.PathLike,
    max_cached_experts: int | None = None,
    threads: int | None = None,
    cache_margin: float = 0.0,
) -> BundleRuntime:
    """A bundle ready to predict: `max_cached_experts` experts kept loaded (None: all), `cache_margin` a gate margin
    for cache-aware routing (expert_choice.pick_experts; 0: plain top-k)."""
    return BundleRuntime(path, max_cached_experts, threads, cache_margin=cache_margin)
