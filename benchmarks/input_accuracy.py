"""Does the batched input path train as well as the per-image one? Test top-1 of a small ViT trained with the deit
recipe per seed: per image (workers), cropped in the workers (crop), per batch on the device (device), and per image
from the data packed at --accuracy-max-side:

    python benchmarks/input_accuracy.py fashion-mnist:train=6000,val=1000,test=2000 --seeds 3 --epochs 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from input_bench import finish  # noqa: E402

from mobile_moe.data import store  # noqa: E402
from mobile_moe.data.datasets import open_data  # noqa: E402

ACCURACY_MODEL = ["--model", "vit", "--size", "4x64", "--patch", "8", "--image-size", "32", "--pool", "mean"]


def test_top1(run: Path) -> float:
    import contextlib
    import io

    from mobile_moe.app.cli import main as cli

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli(["evaluate", str(run), "--json"]) == 0
    return json.loads(printed.getvalue())["top1"]


def accuracy(spec: str, out: Path, args) -> dict:
    """{variant: [test top-1 per seed]}: the deit recipe (peak lr 2e-3 at batch 128, warm-up 1 epoch) per image, on
    the device, and per image from the spec packed at --accuracy-max-side."""
    from mobile_moe.app.cli import main as cli

    side = args.accuracy_max_side
    packed = store.pack(open_data(spec, side), out / "accuracy-store", max_side=side)
    variants = {"workers": (spec, "workers"), "crop": (spec, "crop"), "device": (spec, "device"),
                f"workers, packed at {side} px": (f"packed:{packed}", "workers")}  # fmt: skip
    found = {name: [] for name in variants}
    for seed in range(args.seeds):
        for name, (data, pipeline) in variants.items():
            run = out / "accuracy" / f"{name.split(',')[0]}-{data.split(':')[0]}-{seed}"
            argv = ["train", *ACCURACY_MODEL, "--data", data, "--recipe", "deit", "--epochs", str(args.epochs),
                    "--batch-size", "128", "--seed", str(seed), "--input-pipeline", pipeline, "--workers", "0",
                    "--lr", "2e-3", "--set", "warmup_epochs=1", "--device", "cpu", "--quiet",
                    "--out", str(run)]  # fmt: skip
            assert cli(argv) == 0
            found[name].append(test_top1(run))
    return found


def print_accuracy(found: dict) -> None:
    print("\n| variant | test top-1 per seed | mean | std |\n|---|---|---:|---:|")
    for name, values in found.items():
        per_seed = ", ".join(f"{100 * v:.2f}" for v in values)
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"| {name} | {per_seed} | {100 * statistics.mean(values):.2f} | {100 * std:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", metavar="SPEC", help="the data to train on (e.g. fashion-mnist:...)")
    parser.add_argument("--accuracy-max-side", type=int, default=16, help="the store's --max-side (default 16)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10, help="epochs per run (default 10)")
    parser.add_argument("--out", type=Path, help="keep the runs and results.json here (default: a temp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        report = {"torch": torch.__version__, "accuracy": accuracy(args.spec, out, args)}
        print_accuracy(report["accuracy"])
        return finish(report, out)


if __name__ == "__main__":
    sys.exit(main())
