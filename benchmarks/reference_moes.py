"""Every registered model on the same backbone, side by side: train on digits, evaluate, export, bench (CPU).

    .venv/bin/python benchmarks/reference_moes.py [--out DIR] [--epochs N] [--experts E] [--top-k K] [--iterations N]

Runs only `mobile-moe` commands, the way a user would: a dense `vit` first (it is also Hard MoE's gater and the source
of the Mobile V-MoE's super-classes), then every MoE with E experts, k experts per image or token (Hard MoE: 1), the
last L=2 blocks as MoE blocks (WideNet: all blocks, sharing one). Prints one markdown table (and writes it to
DIR/table.md, the raw numbers to DIR/table.json): params total; params active per image from the config (worst case)
and as measured on the test split (the distinct experts each image reached, per MoE layer, times an expert's
parameters, plus every non-expert parameter); FLOPs per image; test top-1; exported ExecuTorch size; host p50 on the
native runner (1 thread) and the graph bytes loaded per image. Every model runs the same bench command, so the
latency column is measured in the same run; the host is shared, read the spread in DIR/bench/report.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from mobile_moe.export.manifest import read_manifest

BACKBONE = ["--size", "4x64", "--patch", "8", "--image-size", "32", "--pool", "mean"]
MOE_LAYERS = 2


def mobile_moe(*argv: str) -> str:
    """Run one `mobile-moe` command; its stdout. A failure stops the comparison with the command's own error line."""
    result = subprocess.run([sys.executable, "-m", "mobile_moe", *argv], capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"mobile-moe {' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return result.stdout


def model_flags(name: str, experts: int, top_k: int) -> list[str]:
    flags = ["--model", name, *BACKBONE]
    if name == "vit":
        return flags
    flags += ["--experts", str(experts)]
    if name in ("mobile-vmoe", "vmoe", "widenet"):
        flags += ["--top-k", str(top_k)]
    if name != "widenet":
        flags += ["--moe-layers", str(MOE_LAYERS)]
    return flags


def train(name: str, out: Path, args: argparse.Namespace, extra: list[str]) -> Path:
    run = out / "runs" / name
    if not (run / "best.pt").exists():
        common = ["--data", "digits", "--recipe", "tiny", "--epochs", str(args.epochs), "--device", "cpu", "--quiet"]
        mobile_moe("train", *model_flags(name, args.experts, args.top_k), *common, *extra, "--out", str(run))
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="reference-moes")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--experts", type=int, default=5)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args()
    out = Path(args.out)
    from mobile_moe.models.registry import list_models

    dense = train("vit", out, args, [])
    super_classes = out / "super_classes.json"
    if not super_classes.exists():
        mobile_moe("superclass", "derive", "--run", str(dense), "-E", str(args.experts), "--out", str(super_classes))
    extra = {"mobile-vmoe": ["--super-classes", str(super_classes)], "hard-moe": ["--init-from", str(dense)]}
    names = ["vit", "mobile-vmoe", *(name for name in list_models() if name not in ("vit", "mobile-vmoe"))]
    runs = {name: train(name, out, args, extra.get(name, [])) if name != "vit" else dense for name in names}
    rows = {}
    for name, run in runs.items():
        info = json.loads(mobile_moe("info", *model_flags(name, args.experts, args.top_k), "--num-classes", "10",
                                     "--json"))  # fmt: skip
        scores = json.loads(mobile_moe("evaluate", str(run), "--split", "test", "--json"))
        bundle = out / "bundles" / name
        mobile_moe("export", str(run), "--format", "executorch", "--out", str(bundle))
        rows[name] = {"info": info, "scores": scores, "bundle_bytes": read_manifest(bundle).bundle_bytes()}
    bench_argv = [*(str(out / "bundles" / name) for name in runs), "--runtime", "native", "--threads", "1"]
    bench_argv += ["--iterations", str(args.iterations), "--data", "digits", "--out", str(out / "bench"), "--json"]
    results = json.loads(mobile_moe("bench", *bench_argv))
    for run in results["runs"]:
        rows[run["model"] if run["model"] in rows else Path(run["bundle"]).name]["bench"] = run
    table = markdown(rows)
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "table.json").write_text(json.dumps(rows, indent=1))


def measured_active(row: dict) -> float | None:
    """Non-expert parameters + the measured mean of expert runs per image (over every expert set) x an expert's size."""
    info, scores = row["info"], row["scores"]
    if info["routing"] == "none":
        return info["params_active"]
    return info["params_shared"] + scores["experts_per_image_mean"] * info["params_per_expert"]


def markdown(rows: dict) -> str:
    header = (
        "| model | routing | params total | active / image (config max) | active / image (measured mean) | "
        "experts run / image (mean, max) | MFLOPs / image | test top-1 | .pte size | host p50 | bytes loaded / image |"
    )
    lines = [header, "|" + "---|" * 11]
    for name, row in rows.items():
        info, scores, bench = row["info"], row["scores"], row.get("bench", {})
        active = measured_active(row)
        distinct = (
            f"{scores['experts_per_image_mean']:.2f}, {scores['experts_per_image_max']}"
            if "experts_per_image_mean" in scores
            else "-"
        )
        latency = bench.get("latency_ms", {}).get("p50")
        latency = "-" if latency is None else f"{latency:.3f} ms"
        loaded = bench.get("bytes_loaded_per_image")
        loaded = "-" if loaded is None else f"{loaded / 1e3:.0f} KB"
        lines.append(
            f"| {name} | {info['routing']} | {info['params_total'] / 1e3:.1f}K | {info['params_active'] / 1e3:.1f}K | "
            f"{'-' if active is None else f'{active / 1e3:.1f}K'} | {distinct} | {info['flops'] / 1e6:.2f} | "
            f"{100 * scores['top1']:.1f}% | {row['bundle_bytes'] / 1e3:.0f} KB | "
            f"{latency} | {loaded} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
