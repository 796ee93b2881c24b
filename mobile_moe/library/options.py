"""libmobile_moe's options, `mm_options` of include/mobile_moe.h: the one table of their names, meanings, encodings,
defaults and bounds.

Every layer takes them from here: the library's defaults and checks (generated into src/options_schema.h:
`python -m mobile_moe.library.options --cpp-header > libmobile_moe/src/options_schema.h`), the
Python binding's struct (binding.py), the flags of the native runner, `mobile-moe bench` and `mobile-moe predict`
(each `--` + the name with dashes, taking the C encoding), and the Java Options (a setter per option, the name in
camelCase). tests/library/test_options_contract.py holds every one of them to this table.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from mobile_moe.errors import UsageError

INT_MAX = 2**31 - 1
MAX_THREADS = 1024  # ExecuTorch's pool at more threads than this is a mistake, never a phone
MAX_EXPERTS = 4096  # the manifest schema's MAX_EXPERTS: no bundle has more
MAX_WEIGHT_CACHE_MIB = 1 << 24  # 16 TiB


@dataclass(frozen=True)
class Option:
    """One field of mm_options. `kind`: "int", "float" or "path" (a C string: None is NULL)."""

    name: str
    kind: str
    default: Any
    low: float | None
    high: float | None
    meaning: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def java_setter(self) -> str:
        first, *rest = self.name.split("_")
        return first + "".join(part.capitalize() for part in rest)

    @property
    def c_type(self) -> str:
        return {"int": "int", "float": "float", "path": "const char*"}[self.kind]

    def bounds(self) -> str:
        return f"{self.low}..{self.high}" if self.kind == "int" else f"{self.low:g}..{self.high:g}"

    def check(self, value: Any, name: str | None = None) -> Any:
        """`value` if this option takes it, else UsageError naming `name` (default: the flag) and the bounds."""
        name = name or self.flag
        if self.kind == "path":
            if value is not None and not isinstance(value, str):
                raise UsageError(f"{name} {value!r}: a folder's path, \"\" for none")
            return value
        number_types = (int,) if self.kind == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, number_types):
            raise UsageError(f"{name} {value!r}: {'an integer' if self.kind == 'int' else 'a number'}, please")
        if not (math.isfinite(value) and self.low <= value <= self.high):
            raise UsageError(f"{name} {value}: out of range ({self.bounds()})")
        return value

    def add_flag(self, parser: argparse.ArgumentParser) -> None:
        """This option as a command's flag, its default the library's (so a command left alone runs as an app)."""
        kind = {"int": int, "float": float, "path": str}[self.kind]
        default = "the library's per-user folder" if self.default is None else f"{self.default:g}"
        parser.add_argument(self.flag, type=kind, default=self.default, help=f"{self.meaning} (default {default})")


OPTIONS: tuple[Option, ...] = (
    Option("threads", "int", 1, 0, MAX_THREADS,
           "inference threads: 1 the calling thread alone; N > 1 ExecuTorch's shared pool at N threads; 0 that pool "
           "at the size it has"),
    Option("cache_experts", "int", -1, -1, MAX_EXPERTS,
           "expert graphs kept loaded: -1 the bundle's top_k, the fewest an image needs (the router and one expert "
           "in memory); 0 every expert; N that many"),
    Option("park_experts", "int", -1, -1, MAX_EXPERTS,
           "evicted experts that keep their methods with their weights' pages dropped, so a switch back skips the "
           "load: -1 every one; 0 none (evicted experts unload); N that many"),
    Option("cache_margin", "float", 0.0, 0.0, 1.0,
           "cache-aware routing: a loaded expert whose gate is within this margin of the top one is taken; 0 plain "
           "top-k"),
    Option("weight_cache_dir", "path", None, None, None,
           "XNNPACK's packed weights on disk, one checked file per graph, and the files verified at open: unset the "
           "per-user folder (MOBILE_MOE_WEIGHT_CACHE, else $XDG_CACHE_HOME or ~/.cache, then "
           "mobile-moe/packed-weights; off, with a log line, where none can be used); a folder, created if missing; "
           "\"\" off"),
    Option("weight_cache_limit_mib", "int", 1024, 1, MAX_WEIGHT_CACHE_MIB,
           "what the packed-weight folder may hold, in MiB; the least recently used graphs are dropped beyond it"),
    Option("prefetch", "int", 1, 0, 1,
           "1: a missed expert loads on a second thread while the trunk's tail runs (bundles with early routing); "
           "0: in line"),
)
OPTION = {option.name: option for option in OPTIONS}
# The options export's Python runtime honours too, for the bundles libmobile_moe does not run (ONNX, Core ML).
EVERY_RUNTIME = ("threads", "cache_experts", "cache_margin")


def checked(values: dict[str, Any], flags: bool = True) -> dict[str, Any]:
    """`values` (option name -> value) checked against the table: an unknown name or a value out of range is a
    UsageError naming it, as a command's flag or (`flags` False) as the option's name."""
    for name, value in values.items():
        if name not in OPTION:
            raise UsageError(f"{name}: not one of libmobile_moe's options ({', '.join(OPTION)})")
        OPTION[name].check(value, None if flags else name)
    return values


def changed(values: dict[str, Any]) -> dict[str, Any]:
    """The options in `values` that differ from the library's defaults: what a front end passes on, so that what it
    leaves alone is the library's own default."""
    return {name: value for name, value in checked(values).items() if value != OPTION[name].default}


def library_only(values: dict[str, Any]) -> list[str]:
    """The options in `values` that differ from the defaults and that a runtime other than libmobile_moe has no
    use for (EVERY_RUNTIME's are the ones it takes): what such a runtime refuses rather than ignores."""
    return [name for name in changed(values) if name not in EVERY_RUNTIME]


def from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options a command's flags (add_flag's) gave, by name."""
    return {option.name: getattr(args, option.name) for option in OPTIONS}


def runner_flags(values: dict[str, Any]) -> list[str]:
    """The native runner's flags for `values`, the ones that differ from the defaults."""
    flags = []
    for name, value in changed(values).items():
        flags += [OPTION[name].flag, repr(value) if isinstance(value, float) else str(value)]
    return flags


def describe(values: dict[str, Any]) -> str:
    """How a configuration reads in a report: "the library's defaults", or the options that differ from them."""
    different = changed(values)
    if not different:
        return "the library's defaults"
    return ", ".join(f"{name} {value!r}" if isinstance(value, str) else f"{name} {value:g}"
                     for name, value in different.items())  # fmt: skip


def markdown_table() -> str:
    """The options as docs/app-library.md lists them (tests/library/test_options_contract.py compares the two)."""
    rows = ["| option (C, Python) | flag | Java | default | range | meaning |", "|---|---|---|---|---|---|"]
    for option in OPTIONS:
        default = "NULL / None" if option.default is None else f"{option.default:g}"
        bounds = "a path, or \"\"" if option.kind == "path" else option.bounds()
        rows.append(f"| `{option.name}` | `{option.flag}` | `{option.java_setter}` | {default} | {bounds} | "
                    f"{option.meaning} |")  # fmt: skip
    return "\n".join(rows) + "\n"


# --- the same table for libmobile_moe ---------------------------------------------------------------------------------

CPP_HEADER = "libmobile_moe/src/options_schema.h"


def _cpp_value(option: Option, value: Any) -> str:
    return f"{value!r}f" if option.kind == "float" else str(value)


def cpp_header() -> str:
    """src/options_schema.h: each option's name, default and bounds, which the library's mm_default_options and
    mm_open's checks use (tests/library/test_options_contract.py checks the committed file against this)."""
    lines = [
        "// Generated from mobile_moe/library/options.py, the one table of mm_options, by",
        f"//   python -m mobile_moe.library.options --cpp-header > {CPP_HEADER}",
        "// Do not edit: change the table and regenerate (tests/library/test_options_contract.py compares the two).",
        "#pragma once",
        "",
        "namespace mobile_moe::library {",
        "",
        "// A numeric option of mm_options: its name (the field's), default and inclusive bounds.",
        "template <typename Value>",
        "struct NumericOption {",
        "  const char* name;",
        "  Value default_value, low, high;",
        "};",
        "",
    ]
    for option in OPTIONS:
        constant = "kOption" + "".join(part.capitalize() for part in option.name.split("_"))
        if option.kind == "path":
            lines.append(f"inline constexpr const char* {constant} = {option.name!r};".replace("'", '"'))
            continue
        values = ", ".join(_cpp_value(option, v) for v in (option.default, option.low, option.high))
        lines.append(f'inline constexpr NumericOption<{option.c_type}> {constant}{{"{option.name}", {values}}};')
    lines += ["", "}  // namespace mobile_moe::library", ""]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m mobile_moe.library.options --cpp-header|--markdown
    import sys

    if sys.argv[1:] not in (["--cpp-header"], ["--markdown"]):
        raise SystemExit("usage: python -m mobile_moe.library.options --cpp-header|--markdown")
    print(cpp_header() if sys.argv[1] == "--cpp-header" else markdown_table(), end="")
