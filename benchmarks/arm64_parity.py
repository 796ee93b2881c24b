"""ARM64 against the host: the native runner cross-built for linux-arm64 and run under qemu-user (the emulated device,
mobile_moe/device_bench/arm64.py) against the host runner, on the same bundles and the same images.

    .venv/bin/python benchmarks/arm64_parity.py BUNDLE... [--data digits] [--images 64] [--iterations 20]

Needs `make arm64`. Per bundle it prints the max abs logit difference, how many images get the same class and the
same experts, whether both opened the same files, the graph bytes each loaded, and both warm p50 latencies with their
ratio: that ratio is the cost of emulation on this machine, never a phone's latency.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from mobile_moe.device_bench import arm64
from mobile_moe.device_bench.native_runner import run_native
from mobile_moe.device_bench.results import host_parity, validate_round
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.device_bench.workload import make_workload, write_raw
from mobile_moe.export.manifest import read_manifest
from mobile_moe.library.build import build_runner


def compare(bundle: Path, data: str, images: int, settings: RoundSettings, scratch: Path) -> str:
    manifest = read_manifest(bundle, verify_files=True)
    inputs = write_raw(make_workload(data, manifest, images, bundle=bundle), scratch / f"{bundle.name}.f32")
    host = validate_round(run_native(build_runner(), bundle, inputs, settings), "native runner")
    arm = validate_round(arm64.run_emulated(None, bundle, inputs, settings), "ARM64 runner")
    parity = host_parity(arm, host, reference="native runner (this host)")
    same_files = sorted(arm.files_opened) == sorted(host.files_opened)
    loaded = [run.graph_bytes_loaded_total for run in (host, arm)]
    p50 = [run.latency_ms.p50 for run in (host, arm)]
    count = parity["images"]
    return (
        f"| {bundle.name} | {parity['max_abs_logit_diff']:.2e} | {parity['same_class']}/{count} "
        f"| {parity['same_experts']}/{count} | {'same' if same_files else 'DIFFERENT'} ({len(arm.files_opened)}) "
        f"| {loaded[0] / 1e6:.2f} / {loaded[1] / 1e6:.2f} | {p50[0]:.2f} | {p50[1]:.2f} | {p50[1] / p50[0]:.1f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--data", default="digits", help="images: random[:SEED] or a data spec (default digits)")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    arm64.require()
    settings = RoundSettings(iterations=args.iterations, warmup=3, switch_repeats=0)
    print(f"ARM64 ({arm64.CPU} under qemu-user) vs host runner, {args.images} images of {args.data}, 1 thread")
    print("| bundle | max abs logit diff | same class | same experts | files opened | MB loaded host / arm64 "
          "| host p50 ms | arm64 p50 ms (emulated) | emulated / host |")  # fmt: skip
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as scratch:
        for bundle in args.bundles:
            print(compare(bundle, args.data, args.images, settings, Path(scratch)), flush=True)


if __name__ == "__main__":
    main()
