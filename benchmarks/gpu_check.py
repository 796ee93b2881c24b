"""The whole GPU path in one command, one table: `make gpu-check` (on a machine without CUDA: `make gpu-check GPU=0`,
which runs every step that can run on the CPU and says which cannot).

    python benchmarks/gpu_check.py [--cpu] [--out DIR] [--budget-s SECONDS] [--only STEP...] [--log DIR]

Steps, each a fresh process (its exit status, time and last line go in the table), the headline figures first
(on CUDA: the train step, the input pipeline, the gpu tests, in a 420 s budget; then the rest):
  input pipeline  benchmarks/input_gpu_epoch.py: a real epoch's images/s (--input-pipeline crop) over the step alone
                  (DeiT-Ti/16, compiled, bf16, b256) from a folder and a store, where the epoch's time goes, and the
                  store loader's margin beside the step (--cpu: input_host_cost.py, the host's CPU per image)
  gpu decoders    benchmarks/gpu_decoders.py: a folder's JPEGs decoded on the GPU, torchvision's nvJPEG call against
                  nvImageCodec's (whole and ROI), images/s (CUDA only; nvImageCodec from .whl/optional where carried)
  gpu tests       pytest -m gpu (tests/test_gpu.py: compiled CUDA training, CUDA checkpoints on a CPU, ...)
  train MODEL     one epoch of every registry model on digits, bf16 autocast on CUDA (hard-moe from the vit run)
  train compile   mobile-vmoe with --compile
  ddp N           torchrun, nccl (gloo with --cpu), world size 1, and 2 where two GPUs exist
  reproduce       fig3b's cells on digits, 1 epoch, on the device, with --bench (exports, native runner) where
                  executorch is installed (a GPU machine's image has none: then without --bench, and the table says so)
  train step      benchmarks/gpu_train_step.py --cuda-graphs --anchor --profile for vit and mobile-vmoe: eager,
                  compiled and CUDA-graphed, vit against timm's deit_tiny, and where each compiled step's device
                  time goes, kernel by kernel, in its log (--cpu: train_step.py at a small size)
  train step every model
                  the same, every registry model, eager and compiled (per FLOP against vit); with the first, two
                  runs of the headline pair: its run-to-run spread. Compiling every model takes minutes.
The run stops starting steps once --budget-s is spent (the table says which were not reached).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mobile_moe.models.registry import list_models

REPO = Path(__file__).resolve().parents[1]
# glog-style warnings, torchrun's banner, kineto's profiler lines ("ERROR:2026-... gpuGetDeviceCount failed" on a
# machine without CUDA): not a step's last word
NOISE = re.compile(r"^([WIE]\d{4} |\*+$|(ERROR|USDT):\d{4}-\d\d-\d\d )")
SMALL = ["--size", "4x64", "--patch", "8", "--image-size", "32", "--pool", "mean"]


def steps(device: str, out: Path, gpus: int) -> list[tuple[str, list[str]]]:
    """(name, argv) for every step, in order."""
    cli = [sys.executable, "-m", "mobile_moe"]
    train = [*cli, "train", *SMALL, "--data", "digits", "--recipe", "tiny", "--epochs", "1", "--device", device,
             "--quiet"]  # fmt: skip
    moe = ["--experts", "5", "--super-classes", "random"]
    tests = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "--durations", "10",
             str(REPO / "tests" / "test_gpu.py")]  # fmt: skip
    if device == "cuda":  # four workers on one GPU: the compile tests' time is inductor's, on the host's cores
        tests += ["-n", "4"] if importlib.util.find_spec("xdist") else []
        tests += ["--timeout", "300"] if importlib.util.find_spec("pytest_timeout") else []
    found = [("gpu tests", tests)]
    extra = {"vit": [], "mobile-vmoe": moe, "hard-moe": ["--experts", "5", "--init-from", str(out / "train-vit")]}
    for name in ["vit", *(name for name in list_models() if name != "vit")]:  # hard-moe starts from vit's run
        found.append((f"train {name}", [*train, "--model", name, *extra.get(name, ["--experts", "5"]),
                                        "--out", str(out / f"train-{name}")]))  # fmt: skip
    found.append(("train compile", [*train, "--model", "mobile-vmoe", *moe, "--compile", "--out", str(out / "c")]))
    for world in [1, 2] if gpus >= 2 or device == "cpu" else [1]:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
        found.append((f"ddp {world}", [*torchrun, *train[1:], "--model", "mobile-vmoe", *moe, "--batch-size", "32",
                                       "--out", str(out / f"ddp-{world}")]))  # fmt: skip
    reproduce = [*cli, "reproduce", "fig3b", "--data", "digits", "--scale", "tiny", "--epochs", "1", "--device",
                 device, "--out", str(out / "fig3b")]  # fmt: skip
    if importlib.util.find_spec("executorch") is not None:  # --bench exports ExecuTorch bundles
        found.append(("reproduce", [*reproduce, "--bench", "--iterations", "5"]))
    else:
        found.append(("reproduce (no --bench: no executorch here)", reproduce))
    # 6,400 images, one round: two rounds of 12,800 took 318 s of the call's budget on an H200 (2026-12-04); the
    # epoch's steady window (SteadyWindow) leaves the start out, so a shorter epoch should read the same ratio (not yet
    # measured at both sizes: compare with input_pipeline.results.md's 12,800-image figures)
    feed = ["input_gpu_epoch.py", "--images", "6400"] if device == "cuda" else [
        "input_host_cost.py", "--images", "64", "--batches", "1", "--batch-size", "16", "--rounds", "1"]  # fmt: skip
    found.insert(0, ("input pipeline", [sys.executable, str(REPO / "benchmarks" / feed[0]), *feed[1:]]))
    if device == "cuda":  # which decoder a folder's JPEGs should take: nvImageCodec from .whl/optional where carried
        wheels = REPO / ".whl" / "optional"
        found.insert(1, ("gpu decoders", [sys.executable, str(REPO / "benchmarks" / "gpu_decoders.py"),
                                          *(["--wheels", str(wheels)] if wheels.is_dir() else [])]))  # fmt: skip
    if device == "cuda":  # the headline pair first of all, CUDA-graphed too; every model last (the pair's second run)
        bench = [sys.executable, str(REPO / "benchmarks" / "gpu_train_step.py"), "--json", "--anchor"]
        found.insert(0, ("train step", [*bench, "--cuda-graphs", "--profile", "--models", "vit", "mobile-vmoe"]))
        tests_at = next(index for index, (name, _) in enumerate(found) if name == "gpu tests")
        found.insert(2, found.pop(tests_at))  # then the input pipeline, then the gpu tests, before the decoders
        found.append(("train step every model", bench))
    else:
        found.append(("train step", [sys.executable, str(REPO / "benchmarks" / "train_step.py"), "--json", "--compile",
                                     "--size", "3x64", "--patch", "8", "--image-size", "32", "--num-classes", "10",
                                     "--experts", "4", "--batch-size", "16", "--steps", "3", "--warmup", "2",
                                     "--models", "vit", "mobile-vmoe", "--anchor", "--profile"]))  # fmt: skip
    return found


def run_step(argv: list[str], timeout: float, log: Path | None) -> tuple[str, float, str, str]:
    """-> (status, seconds, its standard output, the last line of its output); its whole output in `log` too."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as stopped:
        if log:  # what the step printed before it was stopped: bytes, even with text=True (subprocess's own rule)
            printed = [part.encode() if isinstance(part, str) else part for part in (stopped.stdout, stopped.stderr)]
            log.write_bytes(b"".join(part for part in printed if part))
        return "timeout", time.perf_counter() - start, "", f"stopped after {timeout:.0f} s"
    if log:
        log.write_text(done.stdout + done.stderr)
    lines = [line for line in (done.stdout + done.stderr).strip().splitlines() if not NOISE.match(line)]
    status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
    return status, time.perf_counter() - start, done.stdout, lines[-1][:160] if lines else ""


def run_summary(argv: list[str]) -> str | None:
    """A training step's result from its run directory: the last epoch's val top-1 and images/s."""
    if "--out" not in argv:
        return None
    metrics = Path(argv[argv.index("--out") + 1]) / "metrics.jsonl"
    if not metrics.is_file():
        return None
    row = json.loads(metrics.read_text().splitlines()[-1])
    return f"val top-1 {100 * row['val_top1']:.1f}%, {row['images_per_s']:.0f} img/s"


def train_step_summary(text: str) -> tuple[str, bool]:
    """The benchmark's JSON -> (per mode the Mobile V-MoE / dense ratio and the worst MoE per FLOP, then vit / timm, the
    dispatch, graph breaks, timed compiles and any mode that failed; whether one did). The whole report is in the step's
    log."""
    report = json.loads(text[text.index("{") :])
    parts = []
    for mode in report["variants"]:
        per_flop = {name: row[f"{mode} per FLOP"] for name, row in report["ratios"].items() if name != "vit"}
        found = [f"MoE/dense {report['ratios']['mobile-vmoe'][f'{mode} / dense {mode}']:.3f}x"
                 ] if "mobile-vmoe" in per_flop else []  # fmt: skip
        if per_flop:
            worst = max(per_flop, key=per_flop.get)
            found.append(f"worst per FLOP {worst} {per_flop[worst]:.2f}")
        parts += [f"{mode}: {', '.join(found)}"] if found else []
    runs = [run for by in report["variants"].values() for run in by.values()]
    parts.append(f"{report.get('expert_dispatch', '?')}; graph breaks {sum(run['graph_breaks'] for run in runs)}, "
                 f"timed compiles {sum(run['timed_compiles'] for run in runs)}")  # fmt: skip
    for mode, by in report.get("anchor", {}).items():
        (_, theirs), ours = next(iter(by.items())), by["vit"]
        parts.append(f"vit/timm {mode} {ours['median_ms'] / theirs['median_ms']:.3f}x")
    failed = report.get("failed_modes", {})
    parts += [f"{mode} FAILED: {why}" for mode, why in failed.items()]
    return "; ".join(parts), bool(failed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="no GPU here: run the CPU-checkable parts on the CPU")
    parser.add_argument("--out", type=Path, help="where the runs go (default: a temporary directory, removed)")
    parser.add_argument(
        "--budget-s",
        type=float,
        help="stop starting steps after this many seconds (default: 420 on a GPU, 1800 with --cpu)",
    )
    parser.add_argument("--only", nargs="+", metavar="STEP",
                        help="run these steps alone (the table's names, or their first words)")  # fmt: skip
    parser.add_argument("--log", type=Path, help="write each step's whole output to LOG/<step>.log")
    args = parser.parse_args()
    if args.log:
        args.log.mkdir(parents=True, exist_ok=True)
    args.budget_s = args.budget_s or (1800.0 if args.cpu else 420.0)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; `make gpu-check GPU=0` runs the CPU-checkable parts", file=sys.stderr)
        return 2
    device, gpus = ("cpu", 0) if args.cpu else ("cuda", torch.cuda.device_count())
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        out = args.out or Path(scratch)
        rows, start, failed = [], time.perf_counter(), False
        chosen = [(name, argv) for name, argv in steps(device, out, gpus)
                  if args.only is None or name.startswith(tuple(args.only))]  # fmt: skip
        for name, argv in chosen:
            left = args.budget_s - (time.perf_counter() - start)
            if left <= 0:
                rows.append((name, "not reached", 0.0, "the budget was spent"))
                continue
            log = args.log / f"{name.replace(' ', '-')}.log" if args.log else None
            status, seconds, stdout, last = run_step(argv, left, log)
            if name == "gpu tests" and "skipped" in last and "passed" not in last:
                status = "skipped"  # every gpu test needs CUDA
            if name.startswith("train step") and status == "ok":
                last, failed_modes = train_step_summary(stdout)
                status = "failed modes" if failed_modes else status
            elif status == "ok":
                last = run_summary(argv) or last
            failed |= status not in ("ok", "skipped")
            rows.append((name, status, seconds, last))
    where = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (GPU=0: the CPU-checkable parts)"
    print(f"gpu-check on {where}, torch {torch.__version__}, {gpus} GPU(s)\n")
    print("| step | status | seconds | last line |\n|---|---|---:|---|")
    for name, status, seconds, last in rows:
        print(f"| {name} | {status} | {seconds:.1f} | {last.replace('|', '/')} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
