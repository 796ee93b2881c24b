"""Build a bundle: split the model, export each graph with the chosen backend, write the manifest, check parity
(and, for int8, accuracy on the validation split), and only then move the directory into place.

    export_bundle(model, "bundle/", "executorch", class_names=names, mean=mean, std=std, sample_images=images)

Everything is built in a temporary directory beside the target (mobile_moe.utils.atomic): a failed export, a parity
failure or an interrupt leaves nothing behind, and an existing bundle at the target survives until the new one is
complete and verified.
"""

from __future__ import annotations

import importlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mobile_moe.errors import UsageError
from mobile_moe.export.graphs import Split, split_model
from mobile_moe.export.loaded_graphs import TorchGraph, coreml_runs_here
from mobile_moe.export.manifest import (
    BACKENDS,
    FORMAT,
    MANIFEST,
    VERSION,
    bundle_files,
    graph_entry,
    planned_entry,
    read_manifest,
    validate_manifest,
    write_manifest,
)
from mobile_moe.export.manifest_schema import GraphEntry, Manifest
from mobile_moe.export.parity import PROB_TOLERANCE, measure_parity, parity_passed, parity_summary
from mobile_moe.export.quantization import DEFAULT_COMPRESSION, CoreMLCompression, Quantization, check_groups
from mobile_moe.export.runtime import BundleRuntime, LibraryBundle, load_bundle
from mobile_moe.export.traces import graph_inputs
from mobile_moe.models.costs import costs
from mobile_moe.utils.atomic import atomic_path, check_output_folder, check_writable
from mobile_moe.utils.interrupts import held

# backend -> (module, exporter function); imported only when used, so one backend's import cost is paid alone.
EXPORTERS = {
    "executorch": ("mobile_moe.export.executorch_backend", "export_executorch"),
    "onnx": ("mobile_moe.export.onnx_backend", "export_onnx"),
    "coreml": ("mobile_moe.export.coreml_backend", "export_coreml"),
}
# input.resize when no run says how evaluation resized images (a model exported without one): stretch, said as assumed
ASSUMED_RESIZE = {"policy": "stretch", "origin": "assumed"}
MAX_VAL_IMAGES = 512
DESCRIPTIONS = {
    "images": "image, resized by the manifest's input.resize policy and normalised with its mean/std (NCHW)",
    "tokens": "tokens after the router's dense blocks (batch, tokens, width)",
    "router_probs": "router probabilities over the experts; the runtime takes the top-k",
    "gate": "weight of the chosen expert (its router probability)",
    "logits": "class logits",
    "residual": "tokens after the block's attention half",
    "normed": "residual after the block's second LayerNorm: the expert MLP's input",
    "delta": "the expert MLP's output, to be weighted by its gate and added to the residual",
    "expert_tokens": "token slots expert e of expert set g (MoE block) filled for this image (0: unused)",
}


def exporter(backend: str) -> tuple[Callable[..., Any], str]:
    if backend not in EXPORTERS:
        raise UsageError(f"unknown format {backend!r}: choose one of {', '.join(BACKENDS)}")
    module = importlib.import_module(EXPORTERS[backend][0])
    return getattr(module, EXPORTERS[backend][1]), module.SUFFIX


def check_target(out_dir: Path) -> None:
    """Export replaces a directory only when it is a bundle (by its manifest's format field) holding nothing but the
    bundle's own files: replacing it removes everything in it, and we never remove what we did not write."""
    check_writable(out_dir, directory=True)
    check_output_folder(out_dir, ours=bundle_files, kind=f"mobile-moe bundle ({MANIFEST} with format {FORMAT!r})")


def _random_images(model: nn.Module, count: int = 8) -> Tensor:
    cfg = model.config
    generator = torch.Generator().manual_seed(0)
    return torch.randn(count, cfg.in_chans, cfg.image_size, cfg.image_size, generator=generator)


def _check_parity(bundle: BundleRuntime, model: nn.Module, images: Tensor, strict: bool, note: str) -> dict[str, Any]:
    result = measure_parity(bundle, model, images)
    result.update({"checked_on": note, "prob_tolerance": PROB_TOLERANCE if strict else None})
    result["passed"] = parity_passed(result) if strict else None
    if strict and not result["passed"]:
        raise UsageError(
            f"parity check failed ({note}): {parity_summary(result)} (max |prob error| tolerance "
            f"{PROB_TOLERANCE:.0e}); nothing written"
        )
    return result


@torch.no_grad()
def _validation_top1(bundle: BundleRuntime, model: nn.Module, images: Tensor, labels: Tensor) -> dict[str, Any]:
    eager = model(images).logits.argmax(-1)
    exported = torch.tensor([int(bundle.predict(image.contiguous()).logits.argmax()) for image in images])
    fp32_top1 = float((eager == labels).float().mean())
    quantized_top1 = float((exported == labels).float().mean())
    return {
        "images": len(images),
        "fp32_top1": fp32_top1,
        "quantized_top1": quantized_top1,
        "top1_change": quantized_top1 - fp32_top1,
        "prediction_agreement": float((eager == exported).float().mean()),
    }


def export_bundle(
    model: nn.Module,
    out_dir: str | Path,
    backend: str,
    *,
    class_names: Sequence[str] | None = None,
    super_class_names: Sequence[str] | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    quantize: str = "none",
    monolithic: bool = False,
    layout: str | None = None,
    fp32: bool = False,
    coreml_compression: str = DEFAULT_COMPRESSION,
    sample_images: Tensor | None = None,
    calibration_images: Tensor | None = None,
    val_data: tuple[Tensor, Tensor] | None = None,
    source: str | None = None,
    validation_top1: float | None = None,
    test_top1: float | None = None,
    resize: dict[str, Any] | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> Manifest:
    """Export `model` as a bundle at `out_dir`; returns its manifest. See the module docstring."""
    lowering = Lowering(backend=backend, quantize=quantize, fp32=fp32, coreml_compression=coreml_compression)
    out_dir = Path(out_dir)
    check_target(out_dir)
    model = model.eval()
    split = split_model(model, monolithic=monolithic, layout=layout)
    lowering.check(split.layout)
    cfg = model.config
    check_groups(lowering.chosen, cfg.width, cfg.mlp_hidden)
    class_names = list(class_names) if class_names is not None else [str(c) for c in range(cfg.num_classes)]
    if len(class_names) != cfg.num_classes:
        raise UsageError(f"{len(class_names)} class names for a model with {cfg.num_classes} classes")
    sample_images = _random_images(model) if sample_images is None else sample_images
    calibration = {}
    if "int8" in lowering.schemes.used and backend == "executorch":
        calibration = graph_inputs(split, model, sample_images if calibration_images is None else calibration_images)
    described = {
        "class_names": class_names,
        "super_class_names": list(super_class_names) if super_class_names else None,
        "input": _input(cfg, mean=mean, std=std, resize=resize),
        "source": source,
        **({"validation_top1": validation_top1} if validation_top1 is not None else {}),
        **({"test_top1": test_top1} if test_top1 is not None else {}),
    }
    manifest = _planned_manifest(cfg, split, lowering, described)  # checked before any graph is exported

    with atomic_path(out_dir, directory=True) as tmp:
        entries = _export_graphs(split, lowering, tmp, calibration=calibration, log=log)
        manifest = manifest.updated(graphs=entries)
        manifest = manifest.updated(sizes=manifest.phone_sizes())
        write_manifest(tmp, manifest)
        bundle, note = _runnable(tmp, backend, split)
        strict = lowering.schemes.used == {"none"} and (backend != "coreml" or note.startswith("split"))
        manifest = manifest.updated(parity=_check_parity(bundle, model, sample_images, strict, note))
        log(f"parity ({note}): max |prob error| {manifest.parity['max_abs_prob_error']:.2e}")
        if lowering.schemes.used != {"none"}:
            report = _quantization_report(manifest, split, bundle, model, val_data, backend)
            manifest = manifest.updated(quantization=report)
        write_manifest(tmp, manifest)
        read_manifest(tmp, verify_files=True)  # what was written reads back, every file matching it
        check_target(out_dir)  # again, just before the swap: a file someone put into --out meanwhile is theirs
    return manifest


@dataclass(frozen=True)
class Lowering:
    """How every graph of a bundle is lowered: the backend and its precision options."""

    backend: str
    quantize: str = "none"
    fp32: bool = False
    coreml_compression: str = DEFAULT_COMPRESSION

    def __post_init__(self):
        exporter(self.backend)  # an unknown backend is refused here
        self.schemes.check(self.backend)
        if self.fp32 and self.backend != "coreml":
            raise UsageError("--fp32 applies to Core ML only (ExecuTorch and ONNX bundles are fp32 unless quantized)")
        if self.compressions != CoreMLCompression() and self.backend != "coreml":
            raise UsageError(
                f"--coreml-compression applies to Core ML only; a {self.backend} bundle's weights follow --quantize"
            )

    def check(self, layout: str) -> None:
        """Refuse, in one line, per-part choices a bundle of `layout` cannot take."""
        self.schemes.check(self.backend, layout)
        self.compressions.check(self.schemes, layout)

    @cached_property  # parsed once, on first use (__post_init__): the spellings are the fields, the parts derived
    def schemes(self) -> Quantization:
        return Quantization.parse(self.quantize)

    @cached_property
    def compressions(self) -> CoreMLCompression:
        return CoreMLCompression.parse(self.coreml_compression)

    @property
    def chosen(self) -> frozenset[str]:
        """The schemes of both parts, and on Core ML the compression of each part that is int8."""
        schemes, compressions = self.schemes, self.compressions
        methods = {getattr(compressions, part) for part in ("experts", "rest") if getattr(schemes, part) == "int8"}
        return schemes.used | (methods if self.backend == "coreml" else set())

    @property
    def precision(self) -> str:
        """The manifest's `precision`: one scheme's words, or each part's."""
        experts, rest = self._words("experts"), self._words("rest")
        return rest if experts == rest else f"experts {experts}, rest {rest}"

    def _words(self, part: str) -> str:
        scheme = getattr(self.schemes, part)
        if scheme == "int8":
            return {"executorch": "int8 (XNNPACKQuantizer, pt2e)", "onnx": "int8 (dynamic)"}.get(
                self.backend, getattr(self.compressions, part)
            )
        if scheme == "8da4w":
            return "8da4w (int4 weights in groups of 32, int8 dynamic activations)"
        return "fp16" if self.backend == "coreml" and not self.fp32 else "fp32"


def _input(cfg, *, mean: Sequence[float] | None, std: Sequence[float] | None, resize: dict | None) -> dict[str, Any]:
    """The manifest's `input`: the image tensor, its normalisation, and how an image file is resized to it."""
    return {
        "shape": [1, cfg.in_chans, cfg.image_size, cfg.image_size],
        "dtype": "float32",
        "mean": list(mean) if mean is not None else [0.0] * cfg.in_chans,
        "std": list(std) if std is not None else [1.0] * cfg.in_chans,
        "resize": dict(resize if resize is not None else ASSUMED_RESIZE),
    }


def _planned_manifest(cfg, split: Split, lowering: Lowering, described: dict[str, Any]) -> Manifest:
    """The manifest of `split`'s graphs before any is written (planned entries: no sizes or sha256 yet), which must
    pass its own schema; if not (e.g. the cost accounting claims more active parameters than the graphs hold), that
    is export's bug, said as such. Graphs, sizes and parity are filled in as they are made."""
    suffix = exporter(lowering.backend)[1]
    planned = [planned_entry(spec, f"{spec.name}{suffix}") for spec in split.graphs]
    fields = {
        "format": FORMAT,
        "version": VERSION,
        "backend": lowering.backend,
        "model": cfg.to_dict(),
        "num_experts": getattr(cfg, "num_experts", 1) if split.layout != "dense" else 0,
        "top_k": getattr(cfg, "top_k", 0) if split.layout != "dense" else 0,
        "routing": cfg.routing,
        "params_active_max": costs(cfg).params_active,
        "composition": split.composition,
        "graphs": planned,
        "precision": lowering.precision,
        **described,
    }
    try:
        return validate_manifest(fields)
    except ValueError as error:
        raise UsageError(f"export would write a manifest that breaks its schema ({error}); nothing written") from None


def _export_graphs(
    split: Split, lowering: Lowering, tmp: Path, *, calibration: dict, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Export every graph of `split` into `tmp`; a family of graphs shares one program where the backend can.
    -> the manifest's `graphs` entries, in the split's order. Logs a line per program: one for a shared family."""
    export_graph, suffix = exporter(lowering.backend)
    specs = {spec.name: spec for spec in split.graphs}
    artifacts: dict[str, tuple[Any, float]] = {}  # graph name -> (Artifact, seconds)
    shared: dict[str, list[str]] = {}  # program -> the graphs that share it
    if lowering.backend == "executorch":
        for program, names in split.families.items():
            members = [specs[name] for name in names]
            family = _export_family(program, members, tmp, lowering.schemes.of(members[0].role), calibration, log)
            artifacts.update(family)
            if family:
                shared[program] = list(names)
    for spec in split.graphs:
        if spec.name in artifacts:
            continue
        start = time.perf_counter()
        with held():  # a stop waits for the graph's tracing to end: torch aborts if unwound mid-trace
            artifact = export_graph(
                spec.module,
                spec.example_inputs(),
                tmp / f"{spec.name}{suffix}",
                input_names=[t.name for t in spec.inputs],
                output_names=[t.name for t in spec.outputs],
                quantize=lowering.schemes.of(spec.role),
                calibration=calibration.get(spec.name, ()),
                fp32=lowering.fp32,
                coreml_compression=lowering.compressions.of(spec.role),
                descriptions=DESCRIPTIONS,
                summary=f"mobile-moe {split.layout} graph {spec.name} ({spec.role})",
            )
        artifacts[spec.name] = (artifact, time.perf_counter() - start)
    entries = {spec.name: _timed_entry(spec, *artifacts[spec.name], tmp) for spec in split.graphs}
    in_family = {name for names in shared.values() for name in names}
    for spec in split.graphs:
        if spec.name not in in_family:
            log(_export_line(spec.name, [entries[spec.name]], artifacts[spec.name][0]))
    for program, names in shared.items():
        log(_export_line(program, [entries[name] for name in names], artifacts[names[0]][0]))
    return [entries[spec.name] for spec in split.graphs]


def _timed_entry(spec, artifact, seconds: float, tmp: Path) -> dict[str, Any]:
    entry = graph_entry(spec, artifact, tmp)
    entry["export_seconds"] = round(seconds, 3)
    return entry


def _export_line(name: str, entries: list[dict[str, Any]], artifact) -> str:
    """`  router: 18.62 MB in 12.4 s, not delegated: 21 x aten.native_layer_norm.default`; for a family sharing one
    program, what loading ONE of its graphs reads and the family's time."""
    loaded = GraphEntry.model_validate(entries[0]).load_bytes  # the one reading of what loading a graph reads
    seconds = sum(entry["export_seconds"] for entry in entries)
    family = f"one program for {len(entries)} graphs, each with its own weights file: " if len(entries) > 1 else ""
    per_graph = " per graph" if len(entries) > 1 else ""
    leftover = Counter(artifact.details.get("undelegated_ops") or ())
    note = ", ".join(f"{count} x {op}" for op, count in sorted(leftover.items()))
    line = f"  {name}: {family}{loaded / 1e6:.2f} MB{per_graph} in {seconds:.1f} s"
    return line + (f", not delegated: {note}" if note else "")


def _export_family(
    program: str, members: list, tmp: Path, quantize: str, calibration: dict, log: Callable[[str], None]
) -> dict:
    """{member name: (Artifact, seconds)} for a family lowered once (mobile_moe/export/executorch_family.py), each
    member's seconds its share of the family's; {} if the family cannot share a program (its members are then exported
    one by one, as any graph)."""
    # executorch's Python package takes seconds to import: only an ExecuTorch export pays for it
    from mobile_moe.export.executorch_family import NotShareable, export_executorch_family

    program_path = tmp / f"{program}.pte"
    weight_paths = [tmp / f"{spec.name}.ptd" for spec in members]
    start = time.perf_counter()
    try:
        with held():  # as for one graph (_export_graphs)
            artifacts = export_executorch_family(
                [spec.module for spec in members],
                members[0].example_inputs(),
                program_path,
                weight_paths,
                quantize=quantize,
                calibrations=[calibration.get(spec.name, ()) for spec in members],
            )
    except NotShareable as reason:
        for path in (program_path, *weight_paths):  # ours, written into the bundle's temporary directory
            path.unlink(missing_ok=True)
        log(f"  {program}: one program per graph ({reason})")
        return {}
    seconds = (time.perf_counter() - start) / len(members)
    return {spec.name: (artifact, seconds) for spec, artifact in zip(members, artifacts, strict=True)}


def _runnable(bundle_dir: Path, backend: str, split: Split) -> tuple[BundleRuntime | LibraryBundle, str]:
    """A runtime over the new bundle, and what it runs: the backend itself, or (Core ML off macOS) the split modules
    in PyTorch, which still checks the split and the runtime's composition against the whole model."""
    if backend == "coreml" and not coreml_runs_here():
        modules = {spec.name: spec.module for spec in split.graphs}
        bundle = BundleRuntime(bundle_dir, open_graph=lambda graph: TorchGraph(modules[graph.name], graph))
        return bundle, "split modules in PyTorch (Core ML prediction needs macOS)"
    if backend == "executorch":  # as an app runs it; packed in memory: the bundle's folder is not its final one yet
        return load_bundle(bundle_dir, weight_cache_dir=""), "libmobile_moe"
    return BundleRuntime(bundle_dir), f"{backend} runtime"


def _quantization_report(manifest: Manifest, split, bundle, model, val_data, backend) -> dict[str, Any]:
    fp32_bytes = sum(spec.params for spec in split.graphs) * 4
    report: dict[str, Any] = {
        "method": manifest.precision,
        "bytes": manifest.sizes["total_bytes"],
        "fp32_weight_bytes": fp32_bytes,
        "note": "fp32_weight_bytes = 4 bytes per parameter of each graph (shared weights counted per graph)",
    }
    if val_data is None:
        report["validation"] = {"measured": False, "reason": "no validation split given"}
    elif backend == "coreml":
        report["validation"] = {"measured": False, "reason": "Core ML prediction needs macOS"}
    else:
        images, labels = val_data
        report["validation"] = _validation_top1(bundle, model, images[:MAX_VAL_IMAGES], labels[:MAX_VAL_IMAGES])
    return report
