"""The bench's figures on a user's own folder of photographs: does the routing stream change experts, and does peak
memory measure the model?

    .venv/bin/python benchmarks/photo_folder.py [--out DIR] [--epochs N]

Cuts a folder of real photographs as a new user has one (tests/photos.py: 10 classes cut from scikit-learn's
china.jpg and flower.jpg and matplotlib's grace_hopper.jpg, 500x375 JPEGs with progressive, grayscale, PNG,
EXIF-rotated and 3000x2000 files among them; ROOT/train/<class>, ROOT/val/<class>, sorted by class as every folder
is), then runs the README's "your own folder" path with the mobile-moe commands: a dense ViT, super-classes (E=3), a
Mobile V-MoE, both exported for ExecuTorch (the dense one also int8), and `bench --runtime native --data
imagefolder:ROOT`. Printed:

- the share of consecutive bench images whose expert changes, default settings (--order stratified) and the old
  first-N-in-folder-order (--order folder);
- the dense int8 bundle's peak RSS and the model's share of it at --images 8 and 100 (the runner reads one image at a
  time: they should agree within 5%).

Rounds are interleaved by bench; the figures are medians over its rounds. Say whether the machine was quiet.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from photos import write_photo_folder  # noqa: E402

MODEL = ["--size", "4x64", "--patch", "32", "--image-size", "224", "--pool", "mean"]  # ViT-Ti/32 in shape, small


def mobile_moe(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "mobile_moe", *args], check=True, stdout=subprocess.DEVNULL)


def bench(bundle: Path, folder: Path, out: Path, *flags: str) -> dict:
    mobile_moe("bench", str(bundle), "--runtime", "native", "--data", f"imagefolder:{folder}", "--out", str(out),
               *flags)  # fmt: skip
    return json.loads((out / "results.json").read_text())["runs"][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-photo-folder"))
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    root, photos = args.out, args.out / "photos"
    if not photos.is_dir():
        write_photo_folder(photos)
    data, recipe = ["--data", f"imagefolder:{photos}"], ["--recipe", "tiny", "--epochs", str(args.epochs)]
    if not (root / "dense" / "best.pt").is_file():
        mobile_moe("train", "--model", "vit", *MODEL, *data, *recipe, "--out", str(root / "dense"))
        mobile_moe("superclass", "derive", "--run", str(root / "dense"), "-E", "3", "--out", str(root / "super.json"))
        mobile_moe("train", "--model", "mobile-vmoe", *MODEL, "--experts", "3", *data, "--super-classes",
                   str(root / "super.json"), *recipe, "--out", str(root / "moe"))  # fmt: skip
        mobile_moe("export", str(root / "moe"), "--format", "executorch", "--out", str(root / "bundle-moe"))
        mobile_moe("export", str(root / "dense"), "--format", "executorch", "--quantize", "int8", "--out",
                   str(root / "bundle-dense-int8"))  # fmt: skip
    for order in ("stratified", "folder"):
        run = bench(root / "bundle-moe", photos, root / f"bench-moe-{order}", "--order", order)
        print(f"moe, --order {order}: expert change rate {run['expert_change_rate']:.2f}, histogram "
              f"{run['expert_histogram']}, hit rate (1 cached) {run['cache_hit_rate'].get('1', 0):.2f}; "
              f"{run['workload']}")  # fmt: skip
    for images in (8, 100):
        run = bench(root / "bundle-dense-int8", photos, root / f"bench-dense-{images}", "--images", str(images))
        print(f"dense int8, --images {images}: peak RSS {run['peak_rss_bytes'] / 2**20:.1f} MiB, the model's share "
              f"{run['model_peak_bytes'] / 2**20:.1f} MiB, p50 {run['latency_ms']['p50']:.3f} ms "
              f"(spread {run['spread']['relative']:.0%})")  # fmt: skip


if __name__ == "__main__":
    main()
