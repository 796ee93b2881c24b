"""`mobile-moe bench BUNDLE...`: measure bundles on the host or a phone; write results.json, report.md and plots.

    mobile-moe bench bundles/moe bundles/dense --runtime native --threads 1 --rounds 3 --data digits --out bench/

Each (bundle, round) is one fresh runner process (native C++ runner, or the Python worker around export's runtime),
so cold loads are cold and each process's memory high-water mark is its own. Rounds are separated by a pause (heat,
background work), and results.json keeps the median across rounds with a flag when they disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from device_bench import results as results_module
from device_bench.bundles import read_manifest
from device_bench.native import check_runner
from device_bench.settings import Settings
from device_bench.workload import make_workload, write_raw
from mobile_moe import jsonio
from mobile_moe.atomic import check_writable, write_text_atomic
from mobile_moe.errors import UsageError

RUNTIMES = ("executorch", "onnxruntime", "native", "coreml")
DEFAULT_RUNTIME = {"executorch": "native", "onnx": "onnxruntime", "coreml": "coreml"}  # by bundle backend
BACKEND_OF_RUNTIME = {"executorch": "executorch", "native": "executorch", "onnxruntime": "onnx", "coreml": "coreml"}
REPO_ROOT = Path(__file__).resolve().parent.parent


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "bundles", nargs="+", metavar="BUNDLE", help="bundle directories written by `mobile-moe export`"
    )
    parser.add_argument("--runtime", choices=RUNTIMES, help="default: native for ExecuTorch, onnxruntime for ONNX")
    parser.add_argument("--device", default="host", help="host, or android[:SERIAL] (needs adb and --runner)")
    parser.add_argument("--runner", help="native runner binary (required for android: an arm64 build)")
    parser.add_argument("--iterations", type=int, default=50, help="timed warm runs per round (default 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs before them (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for inference (default 1)")
    parser.add_argument("--cache-experts", type=int, help="expert graphs kept loaded (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="repeat each measurement this many times (default 3)")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between rounds (default 2)")
    parser.add_argument("--data", default="random", help="images: random[:SEED] or a data spec such as digits")
    parser.add_argument("--images", type=int, default=32, help="images in the routing workload (default 32)")
    parser.add_argument("--switch-repeats", type=int, default=2, help="times each expert switch is timed")
    parser.add_argument("--weight-cache", action="store_true", help="native: enable XNNPACK's packed-weight cache")
    parser.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    parser.add_argument("--json", action="store_true", help="print results.json on stdout instead of a summary")


def parse_device(device: str) -> tuple[str, str | None]:
    name, _, serial = device.partition(":")
    if name not in ("host", "android") or (name == "host" and serial):
        raise UsageError(f"--device {device!r}: use host or android[:SERIAL]")
    return name, serial or None


def choose_runtime(requested: str | None, manifest: dict, bundle: str) -> str:
    runtime = requested or DEFAULT_RUNTIME.get(manifest["backend"])
    if runtime is None or BACKEND_OF_RUNTIME[runtime] != manifest["backend"]:
        backend = manifest["backend"]
        article = "an" if backend[0] in "aeiou" else "a"
        raise UsageError(f"{bundle} is {article} {backend} bundle; --runtime {requested} cannot run it")
    return runtime


def python_worker(bundle: str, runtime: str, images: Path, settings: Settings) -> dict:
    """One round with export's Python runtime, in a fresh interpreter."""
    command = [sys.executable, "-m", "device_bench.python_worker", "--bundle", bundle, "--runtime", runtime]
    command += ["--input", str(images), "--iterations", str(settings.iterations), "--warmup", str(settings.warmup)]
    command += ["--threads", str(settings.threads), "--switch-repeats", str(settings.switch_repeats)]
    if settings.cache_experts is not None:
        command += ["--cache-experts", str(settings.cache_experts)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(command, capture_output=True, env=env)
    stderr = result.stderr.decode(errors="replace").strip().splitlines()
    if result.returncode == 2:  # the worker's one line for a bad bundle
        raise UsageError(stderr[-1] if stderr else f"{runtime} worker refused {bundle}")
    if result.returncode != 0:
        raise RuntimeError(f"{runtime} worker failed on {bundle} (status {result.returncode}): {stderr[-1:]}")
    return json.loads(result.stdout)


def one_round(args, bundle: str, runtime: str, device: tuple[str, str | None], images: Path, settings: Settings):
    if runtime == "coreml":
        from device_bench.coreml_runner import require_macos

        require_macos()
    if device[0] == "android":
        if runtime != "native":
            raise UsageError("--device android runs the native runner only: add --runtime native --runner PATH")
        if not args.runner:
            raise UsageError("--device android needs --runner PATH: an Android arm64 build (native/build_android.sh)")
        from device_bench.android import run_on_android

        return run_on_android(device[1], args.runner, bundle, images, settings)
    if runtime == "native":
        from device_bench.native import run_native
        from device_bench.native_build import build_runner

        return run_native(args.runner or build_runner(), bundle, images, settings)
    return python_worker(bundle, runtime, images, settings)


def host_description() -> str:
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def benchmark(args: argparse.Namespace, log=print) -> dict:
    """Measure every bundle; returns the results.json object (also written to --out with the report)."""
    settings = Settings(args.iterations, args.warmup, args.threads, args.cache_experts, args.switch_repeats,
                        args.weight_cache)  # fmt: skip
    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds}: must be at least 1")
    if not 0 <= args.pause <= 3600:
        raise UsageError(f"--pause {args.pause}: seconds between rounds, from 0 to 3600")
    check_writable(args.out, directory=True)  # before measuring, not after
    if args.runner is not None:
        check_runner(args.runner)
    device = parse_device(args.device)
    if args.runtime == "coreml":
        from device_bench.coreml_runner import require_macos

        require_macos()
    manifests = {bundle: read_manifest(bundle) for bundle in args.bundles}  # all checked before any is run
    runtimes = {bundle: choose_runtime(args.runtime, manifests[bundle], bundle) for bundle in args.bundles}
    if "coreml" in runtimes.values():
        from device_bench.coreml_runner import require_macos

        require_macos()
    records = []
    with tempfile.TemporaryDirectory(prefix="mobile-moe-bench-") as scratch:
        for bundle in args.bundles:
            manifest, runtime = manifests[bundle], runtimes[bundle]
            workload = make_workload(args.data, manifest, args.images)
            images = write_raw(workload, Path(scratch) / "images.f32")
            rounds = []
            for index in range(args.rounds):
                if index:
                    time.sleep(args.pause)
                rounds.append(one_round(args, bundle, runtime, device, images, settings))
                p50 = rounds[-1]["latency_ms"]["p50"]
                log(f"{bundle} [{runtime}, {args.device}] round {index + 1}: p50 {p50:.2f} ms")
            record = results_module.run_record(bundle, manifest, runtime, args.device, rounds, workload.source)
            record["raw_first_round"] = rounds[0]
            records.append(record)
    results = {
        "runs": records,
        "host": host_description(),
        "rounds": args.rounds,
        "settings": {**settings.__dict__, "data": args.data, "images": args.images, "pause_s": args.pause},
    }
    results_module.validate_results(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", jsonio.dumps(results, indent=1))
    from device_bench.report import write_report

    write_report(results, out)
    return results


def run(args: argparse.Namespace) -> int:
    log = (lambda message: print(message, file=sys.stderr)) if args.json else print
    results = benchmark(args, log)
    if args.json:
        print(jsonio.dumps(results))
    else:
        print((Path(args.out) / "report.md").read_text())
        print(f"wrote {Path(args.out) / 'results.json'}, report.md and plots")
    return 0


def bench_bundles(
    bundles: list[str | Path],
    out: str | Path,
    *,
    runtime: str | None = None,
    iterations: int = 20,
    warmup: int = 3,
    threads: int = 1,
    rounds: int = 1,
    data: str = "random",
    images: int = 16,
    log=print,
) -> dict:
    """For `mobile-moe demo` and notebooks: benchmark bundles on this host; writes results.json, report.md and plots
    to `out` and returns the results.json object (see DESIGN.md)."""
    parser = argparse.ArgumentParser()
    configure(parser)
    argv = [*map(str, bundles), "--iterations", str(iterations), "--warmup", str(warmup), "--threads", str(threads)]
    argv += ["--rounds", str(rounds), "--pause", "0.5", "--data", data, "--images", str(images), "--out", str(out)]
    return benchmark(parser.parse_args(argv + (["--runtime", runtime] if runtime else [])), log)
