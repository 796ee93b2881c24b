"""`export --quantize`: one scheme for every graph, or one for the experts and one for the rest, in one spelling.

    none                       fp32 (Core ML: fp16 unless --fp32)
    int8                       static int8: activations calibrated on the run's images, weights per channel
    8da4w                      4-bit grouped weights, int8 dynamic activations (ExecuTorch's XNNPACK only)
    experts=SCHEME,rest=SCHEME the expert graphs (a split's `expert` and `block_expert` roles) in one scheme, the
                               router, trunk, shared block halves and head in another

A phone stores every expert and reads one per switch, so the experts are where bytes pay most: experts=8da4w,rest=int8
keeps the router, which decides for every image, at 8 bits. Per-part schemes need a split layout; a bundle of one
graph (dense, monolithic, whole) takes one scheme.
"""

from __future__ import annotations

from dataclasses import dataclass

from mobile_moe.errors import UsageError

SCHEMES = ("none", "int8", "8da4w")
BACKENDS_OF = {"none": ("executorch", "onnx", "coreml"), "int8": ("executorch", "onnx", "coreml"),
               "8da4w": ("executorch",)}  # fmt: skip
EXPERT_ROLES = frozenset({"expert", "block_expert"})  # mobile_moe/export/graphs.py's roles holding an expert
SPLIT_LAYOUTS = ("expert-paths", "per-block")
SPELLING = "none, int8, 8da4w, or experts=SCHEME,rest=SCHEME"


@dataclass(frozen=True)
class Quantization:
    experts: str = "none"
    rest: str = "none"

    @classmethod
    def parse(cls, spelling: str) -> Quantization:
        """'int8' -> both parts int8; 'experts=8da4w,rest=int8' -> each its own. UsageError names what is wrong."""
        if "=" not in spelling:
            return cls(*[_scheme(spelling, spelling)] * 2)
        parts: dict[str, str] = {}
        for item in spelling.split(","):
            part, _, scheme = item.partition("=")
            if part not in ("experts", "rest") or part in parts:
                raise UsageError(f"--quantize {spelling!r}: give experts=SCHEME,rest=SCHEME once each ({SPELLING})")
            parts[part] = _scheme(scheme, spelling)
        if set(parts) != {"experts", "rest"}:
            raise UsageError(f"--quantize {spelling!r}: name both parts, e.g. experts=8da4w,rest=int8")
        return cls(parts["experts"], parts["rest"])

    @property
    def uniform(self) -> bool:
        return self.experts == self.rest

    @property
    def used(self) -> frozenset[str]:
        return frozenset({self.experts, self.rest})

    def of(self, role: str) -> str:
        """The scheme of a graph of `role`: a graph holding experts and the rest together takes the one scheme."""
        return self.experts if role in EXPERT_ROLES else self.rest

    def check(self, backend: str, layout: str | None = None) -> None:
        """Refuse, in one line, a scheme `backend` cannot run or per-part schemes on a one-graph `layout`."""
        for scheme in sorted(self.used):
            if backend not in BACKENDS_OF[scheme]:
                raise UsageError(
                    f"--quantize {scheme}: {' and '.join(BACKENDS_OF[scheme])} only; a {backend} bundle takes "
                    f"{' or '.join(s for s in SCHEMES if backend in BACKENDS_OF[s])}"
                )
        if layout is not None and not self.uniform and layout not in SPLIT_LAYOUTS:
            raise UsageError(
                f"--quantize experts={self.experts},rest={self.rest}: a {layout} bundle is one graph, experts and "
                f"the rest together; give one scheme, or export a split layout ({' or '.join(SPLIT_LAYOUTS)})"
            )


GROUP = 32  # 8da4w: inputs per weight scale


def check_groups(schemes: Quantization, width: int, hidden: int) -> None:
    """8da4w scales every group of GROUP inputs of a Linear: the widths it reads (the model's width, the MLP's
    hidden width) must be whole groups."""
    if "8da4w" in schemes.used and (width % GROUP or hidden % GROUP):
        raise UsageError(
            f"--quantize 8da4w scales weights in groups of {GROUP} inputs: this model's width {width} and MLP hidden "
            f"width {hidden} must both be multiples of {GROUP}; use int8 for it"
        )


def _scheme(scheme: str, spelling: str) -> str:
    if scheme not in SCHEMES:
        raise UsageError(f"--quantize {spelling!r}: {scheme!r} is no scheme; choose {SPELLING}")
    return scheme
