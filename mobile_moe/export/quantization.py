"""`export --quantize` and `--coreml-compression`: one choice for every graph, or one for the experts and one for the
rest, in one spelling.

--quantize SCHEME
    none                       fp32 (Core ML: fp16 unless --fp32)
    int8                       static int8: activations calibrated on the run's images, weights per channel (Core ML:
                               the weights compressed as --coreml-compression says)
    8da4w                      4-bit grouped weights, int8 dynamic activations (ExecuTorch's XNNPACK only)
--coreml-compression METHOD (Core ML's compression of the parts --quantize makes int8; weights only, on the converted
model, coremltools.optimize.coreml)
    linear8                    8-bit symmetric, a scale per output channel (iOS 17)
    linear4                    4-bit symmetric, a scale per block of 32 inputs of an output channel (iOS 18): Core ML's
                               match for 8da4w's weights (it keeps fp16 activations); a weight whose inputs are no
                               whole blocks (the patch embedding's colour channels) as linear8
    palette8|palette6|palette4 k-means palettisation, 2**N entries per weight tensor (iOS 17)
either as experts=CHOICE,rest=CHOICE: the expert graphs (a split's `expert` and `block_expert` roles) in one, the
router, trunk, shared block halves and head in the other.

A phone stores every expert and reads one per switch, so the experts are where bytes pay most: experts=8da4w,rest=int8
(Core ML: --quantize int8 --coreml-compression experts=linear4,rest=linear8) keeps the router, which decides for every
image, at 8 bits. Per-part choices need a split layout; a bundle of one graph (dense, monolithic, whole) takes one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Self

from mobile_moe.errors import UsageError
from mobile_moe.export.manifest_schema import SPLIT_LAYOUTS

SCHEMES = ("none", "int8", "8da4w")
BACKENDS_OF = {"none": ("executorch", "onnx", "coreml"), "int8": ("executorch", "onnx", "coreml"),
               "8da4w": ("executorch",)}  # fmt: skip
EXPERT_ROLES = frozenset({"expert", "block_expert"})  # mobile_moe/export/graphs.py's roles holding an expert
COREML_COMPRESSIONS = ("linear8", "linear4", "palette8", "palette6", "palette4")
DEFAULT_COMPRESSION = "linear8"
IOS18_COMPRESSIONS = frozenset({"linear4"})  # coremltools' per-block quantization needs the iOS 18 opset


@dataclass(frozen=True)
class _Flag:
    """A per-part flag: its name, its choices, and how its help and errors spell them."""

    name: str
    choices: tuple[str, ...]
    noun: str  # what one choice is called: "scheme"
    example: str  # a per-part spelling that works

    @property
    def words(self) -> str:
        return f"{', '.join(self.choices)}, or experts={self.noun.upper()},rest={self.noun.upper()}"

    def parts(self, spelling: str) -> tuple[str, str]:
        """'C' -> (C, C); 'experts=C1,rest=C2' -> (C1, C2): the one grammar of a per-part flag. UsageError names what
        is wrong."""
        if "=" not in spelling:
            return (self._choice(spelling, spelling),) * 2
        parts: dict[str, str] = {}
        for item in spelling.split(","):
            part, _, choice = item.partition("=")
            if part not in ("experts", "rest") or part in parts:
                raise UsageError(f"{self.name} {spelling!r}: give experts=...,rest=... once each ({self.words})")
            parts[part] = self._choice(choice, spelling)
        if set(parts) != {"experts", "rest"}:
            raise UsageError(f"{self.name} {spelling!r}: name both parts, e.g. {self.example}")
        return parts["experts"], parts["rest"]

    def _choice(self, choice: str, spelling: str) -> str:
        if choice not in self.choices:
            raise UsageError(f"{self.name} {spelling!r}: {choice!r} is no {self.noun}; choose {self.words}")
        return choice


QUANTIZE = _Flag("--quantize", SCHEMES, "scheme", "experts=8da4w,rest=int8")
COREML_COMPRESSION = _Flag("--coreml-compression", COREML_COMPRESSIONS, "method", "experts=linear4,rest=linear8")


class _PerPart:
    """A choice for the expert graphs and one for the rest, spelt as `FLAG` says."""

    FLAG: ClassVar[_Flag]
    experts: str
    rest: str

    @classmethod
    def parse(cls, spelling: str) -> Self:
        """'C' -> both parts C; 'experts=C1,rest=C2' -> each its own. UsageError names what is wrong."""
        return cls(*cls.FLAG.parts(spelling))

    @property
    def uniform(self) -> bool:
        return self.experts == self.rest

    @property
    def used(self) -> frozenset[str]:
        return frozenset({self.experts, self.rest})

    def of(self, role: str) -> str:
        """The choice for a graph of `role`: a graph holding experts and the rest together takes the one choice."""
        return self.experts if role in EXPERT_ROLES else self.rest

    def check_layout(self, layout: str | None) -> None:
        """Refuse, in one line, per-part choices on a one-graph `layout` (dense, monolithic, whole)."""
        if layout is not None and not self.uniform and layout not in SPLIT_LAYOUTS:
            raise UsageError(
                f"{self.FLAG.name} experts={self.experts},rest={self.rest}: a {layout} bundle is one graph; give one "
                f"{self.FLAG.noun}, or export a split layout ({' or '.join(SPLIT_LAYOUTS)})"
            )


@dataclass(frozen=True)
class Quantization(_PerPart):
    """--quantize: 'int8' -> both parts int8; 'experts=8da4w,rest=int8' -> each its own."""

    FLAG: ClassVar[_Flag] = QUANTIZE
    experts: str = "none"
    rest: str = "none"

    def check(self, backend: str, layout: str | None = None) -> None:
        """Refuse, in one line, a scheme `backend` cannot run or per-part schemes on a one-graph `layout`."""
        for scheme in sorted(self.used):
            if backend not in BACKENDS_OF[scheme]:
                takes = " or ".join(s for s in SCHEMES if backend in BACKENDS_OF[s])
                if backend == "coreml":
                    takes += f" (4-bit experts: --quantize int8 --coreml-compression {COREML_COMPRESSION.example})"
                raise UsageError(
                    f"--quantize {scheme}: {' and '.join(BACKENDS_OF[scheme])} only; a {backend} bundle takes {takes}"
                )
        self.check_layout(layout)


GROUP = 32  # 8da4w and linear4: inputs per weight scale
GROUPED = {"8da4w": ("--quantize", "int8"), "linear4": ("--coreml-compression", DEFAULT_COMPRESSION)}  # -> flag, 8 bits


def check_groups(chosen: frozenset[str], width: int, hidden: int) -> None:
    """8da4w and Core ML's linear4 scale every group of GROUP inputs of a Linear: the widths it reads (the model's
    width, the MLP's hidden width) must be whole groups: otherwise a Linear would fall back to 8 bits (linear4:
    coreml_backend._in_blocks) or fail to lower (8da4w), and experts asked for in 4 bits would not be."""
    for name in sorted(chosen & GROUPED.keys()):
        if width % GROUP or hidden % GROUP:
            flag, instead = GROUPED[name]
            raise UsageError(
                f"{flag} {name} scales weights in groups of {GROUP} inputs: this model's width {width} and MLP hidden "
                f"width {hidden} must both be multiples of {GROUP}; use {instead} for it"
            )


@dataclass(frozen=True)
class CoreMLCompression(_PerPart):
    """--coreml-compression: how Core ML compresses the weights of each part that --quantize makes int8."""

    FLAG: ClassVar[_Flag] = COREML_COMPRESSION
    experts: str = DEFAULT_COMPRESSION
    rest: str = DEFAULT_COMPRESSION

    def check(self, schemes: Quantization, layout: str | None = None) -> None:
        """Refuse, in one line, a compression nothing would use (a part --quantize leaves in fp16) or per-part methods
        on a one-graph `layout`."""
        if self.uniform:
            if self.rest != DEFAULT_COMPRESSION and "int8" not in schemes.used:
                raise UsageError(
                    f"--coreml-compression {self.rest} compresses the parts --quantize makes int8, and --quantize "
                    "leaves every part in fp16; add --quantize int8"
                )
            return
        for part in ("experts", "rest"):
            if getattr(schemes, part) != "int8" and getattr(self, part) != DEFAULT_COMPRESSION:
                raise UsageError(
                    f"--coreml-compression experts={self.experts},rest={self.rest} compresses the parts --quantize "
                    f"makes int8, and --quantize leaves the {part} in fp16; add --quantize int8"
                )
        self.check_layout(layout)
