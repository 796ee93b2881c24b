"""What each compression scheme costs in accuracy: a Mobile V-MoE trained on Fashion-MNIST, exported per scheme
(ExecuTorch and ONNX, per-block layout), every bundle scored on all 10,000 test images through the Python runtime
(ExecuTorch's, onnxruntime), against the eager fp32 model on the same images.

    python benchmarks/compression_fashion_mnist.py [--train 12000] [--epochs 8] [--out DIR]

Needs Fashion-MNIST's IDX files (Debian: `apt-get install dataset-fashion-mnist`). The model: 4 blocks of width 64
(widths divisible by 8da4w's group of 32), patch 8 at 32 px, mean pooling, E=5 experts on the dataset's 5 coarse
groups, k=1, L=2; the tiny recipe.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from mobile_moe.app.cli import main as cli
from mobile_moe.export.manifest import read_manifest
from mobile_moe.export.runtime import load_bundle
from mobile_moe.training.evaluate import evaluate
from mobile_moe.training.run_dir import load_run

# (backend, --quantize): every scheme each backend takes
SCHEMES = [("executorch", "none"), ("executorch", "int8"), ("executorch", "experts=8da4w,rest=int8"),
           ("executorch", "8da4w"), ("onnx", "none"), ("onnx", "int8")]  # fmt: skip
MODEL = ["--model", "mobile-vmoe", "--size", "4x64", "--patch", "8", "--image-size", "32", "--pool", "mean",
         "--experts", "5", "--super-classes", "coarse", "--recipe", "tiny"]  # fmt: skip


def bundle_top1(bundle: Path, test) -> float:
    runtime = load_bundle(bundle)
    right = sum(int(runtime.predict(image.numpy()).logits.argmax() == label) for image, label in test)
    return right / len(test)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=12000, help="training images (default 12000)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--out", type=Path, help="keep the run and bundles here (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        run = out / "run"
        data = f"fashion-mnist,train={args.train}"
        if not (run / "best.pt").is_file():  # a kept --out's run is scored again, not retrained
            assert cli(["train", *MODEL, "--data", data, "--epochs", str(args.epochs), "--device", "cpu", "--quiet",
                        "--out", str(run)]) == 0  # fmt: skip
        loaded = load_run(run)
        test = loaded.open_data().split("test")
        eager = evaluate(loaded.model, test)["top1"]
        rows = []
        for backend, scheme in SCHEMES:
            bundle = out / f"bundle-{backend}-{scheme.replace(',', '+').replace('=', '-')}"
            assert cli(["export", str(run), "--format", backend, "--layout", "per-block", "--quantize", scheme,
                        "--out", str(bundle)]) == 0  # fmt: skip
            manifest = read_manifest(bundle)
            rows.append((backend, scheme, bundle_top1(bundle, test), manifest.sizes))
            print(f"scored {backend} {scheme}", flush=True)
        print(f"\neager fp32 test top-1 {100 * eager:.2f}% on {len(test)} test images\n")
        print("| backend | scheme | test top-1 | change vs eager fp32 (points) | bundle KB | router + 1 expert KB |")
        print("|---|---|---:|---:|---:|---:|")
        for backend, scheme, top1, sizes in rows:
            total, held = sizes["total_bytes"], sizes["resident_plus_one_expert_bytes"]
            print(f"| {backend} | {scheme} | {100 * top1:.2f}% | {100 * (top1 - eager):+.2f} | {total / 1e3:.0f} "
                  f"| {held / 1e3:.0f} |")  # fmt: skip
        (out / "results.json").write_text(json.dumps({"eager_top1": eager, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
