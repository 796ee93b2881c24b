"""The first launch an app can prepare (mm_prepare), measured: open + first prediction of the example app
(examples/app_example.c, the C API as an app calls it) in a first process on an empty packed-weight folder, in the next
process (a second launch), and in a first process after mm_prepare ran in another one (what an app gets that prepared
at install). Each from a fresh folder, `--rounds` times, alternating; the ratio the goal reads is after-prepare /
second-launch (issue 84: <= 1.2).

    .venv/bin/python benchmarks/first_launch.py BUNDLE IMAGES.f32 [--rounds 5]

Prints a table and appends nothing: copy the table into benchmarks/first_launch.results.md with the machine and load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mobile_moe.library.build import build_runner


def cold_start_ms(app: Path, bundle: Path, images: Path, folder: Path) -> float:
    """mm_open + the first prediction of one new process of the example app, with `folder` for packed weights."""
    command = [str(app), str(bundle), str(images), "--iterations", "1", "--weight-cache-dir", str(folder)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    report = json.loads(result.stdout)
    return report["open_ms"] + report["ms"][0]


def prepare(bundle: Path, folder: Path) -> None:
    script = "import sys; from mobile_moe.library.binding import load_library; " \
             "load_library().prepare(sys.argv[1], weight_cache_dir=sys.argv[2])"  # fmt: skip
    subprocess.run([sys.executable, "-c", script, str(bundle), str(folder)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("images", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    app = build_runner().parent / "cmake-build" / "mobile_moe_app"
    first, second, prepared = [], [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as scratch:
            fresh, ahead = Path(scratch) / "fresh", Path(scratch) / "ahead"
            first.append(cold_start_ms(app, args.bundle, args.images, fresh))
            second.append(cold_start_ms(app, args.bundle, args.images, fresh))
            prepare(args.bundle, ahead)
            prepared.append(cold_start_ms(app, args.bundle, args.images, ahead))
    rows = {"first launch": first, "second launch": second, "first launch after mm_prepare": prepared}
    print("| open + first prediction | median ms | rounds (ms) |\n|---|---:|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    ratios = [p / s for p, s in zip(prepared, second, strict=True)]
    print(f"\nafter mm_prepare / second launch: {statistics.median(ratios):.3f} (median of {len(ratios)}, "
          f"spread {max(ratios) - min(ratios):.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
