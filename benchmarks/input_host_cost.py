"""The host's CPU time per training image of each input path of the deit recipe, from an image folder and from its
packed store, the paths taking turns in every round:

    python benchmarks/input_host_cost.py                       # 640 ImageNet-sized images, 3 rounds
    python benchmarks/input_host_cost.py --images 2000 --rounds 5 --out bench-input

  host CPU ms / image   process CPU time per image of what the host does (workers=0, so it is all in this process):
                        per-image = decode + the whole torchvision pipeline (--input-pipeline workers); device-fed =
                        what the host does when a GPU augments (--input-pipeline device): read bytes (GPU-decodable
                        JPEGs) or decode (the rest), pad, draw; batched on the CPU = the device pipeline where the
                        device is this CPU (decode in the loader, batch_augment here)
  images/s              each path's wall rate, against the per-image path's host CPU (the ratio column)

Each figure the median of --rounds with the spread (min-max); the images are input_bench.py's (a harsh mix of kinds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from itertools import islice
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from input_bench import finish, sources, spread  # noqa: E402

from mobile_moe.data import augment, decode, inputs  # noqa: E402
from mobile_moe.data.batch_augment import StepKey, draw  # noqa: E402
from mobile_moe.data.datasets import open_data  # noqa: E402
from mobile_moe.training import recipes  # noqa: E402


def cpu_seconds(batches, count: int, handle) -> tuple[float, float]:
    """(process CPU s per image, wall images/s) of `handle`-ing `count` batches."""
    cpu, wall = time.process_time(), time.perf_counter()
    images = sum(handle(batch, step) for step, batch in enumerate(islice(batches, count)))
    return (time.process_time() - cpu) / images, images / (time.perf_counter() - wall)


def shuffled(dataset, batch_size: int, seed: int, **options) -> DataLoader:
    """The images a figure reads: a shuffle drawn from `seed`, so every path of a round reads the same ones (a real
    folder mixes cheap and costly files: paths that drew other samples would compare the samples, not the paths)."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=0, drop_last=True,
                      generator=torch.Generator().manual_seed(seed), **options)  # fmt: skip


def per_image(data, aug, batch_size: int, count: int, seed: int):
    """Today's path in the loader: decode + torchvision's per-image pipeline + MixUp/CutMix on the batch."""
    split = inputs.training_split(data, aug, "workers", torch.device("cpu"))
    mixer = augment.batch_mixer(aug, data.num_classes)
    loader = shuffled(split, batch_size, seed)
    to_model = inputs.WorkerBatches(data.num_classes, torch.device("cpu"), mixer)
    return cpu_seconds(loader, count, lambda batch, step: len(to_model.batch(batch, StepKey(0, 0, 0, step))[0]))


def device_fed_host(data, aug, batch_size: int, count: int, seed: int):
    """The host's share when a GPU decodes and augments: read bytes or decode the kinds a GPU cannot, pad, draw."""
    raw = inputs.training_split(data, aug, "device", torch.device("cuda"))  # what a GPU's loader reads; no CUDA call
    loader = shuffled(raw, batch_size, seed, collate_fn=inputs.collate("device"))

    def host_part(batch: decode.RawBatch, step: int) -> int:
        sizes = batch.sizes.numpy()
        crops = inputs.eval_crops(sizes, data.eval_resize, data.image_size)
        draw(aug, sizes, image_size=data.image_size, key=StepKey(0, 0, 0, step), eval_crop=crops)
        return len(sizes)

    return cpu_seconds(loader, count, host_part)


def on_this_device(data, aug, batch_size: int, count: int, seed: int):
    """The whole device pipeline where no GPU is: decode in the loader, batch_augment on the CPU."""
    device = torch.device("cpu")
    split = inputs.training_split(data, aug, "device", device)
    loader = shuffled(split, batch_size, seed, collate_fn=inputs.collate("device"))
    to_model = inputs.DeviceBatches(aug, data, device)
    return cpu_seconds(loader, count, lambda batch, step: len(to_model.batch(batch, StepKey(0, 0, 0, step))[0]))


PATHS = {"per-image": per_image, "device-fed host": device_fed_host, "batched on the CPU": on_this_device}


def cpu_figures(specs: dict[str, str], args) -> dict:
    """{source: {path: {"cpu_ms": [...], "images_per_s": [...]}}}, the paths taking turns in every round."""
    aug = recipes.deit().augmentation
    found = {source: {path: {"cpu_ms": [], "images_per_s": []} for path in PATHS} for source in specs}
    for round_ in range(args.rounds):
        for source, spec in specs.items():
            data = open_data(spec, args.image_size)
            for path, measure in PATHS.items():
                seconds, rate = measure(data, aug, args.batch_size, args.batches, seed=round_)
                found[source][path]["cpu_ms"].append(seconds * 1e3)
                found[source][path]["images_per_s"].append(rate)
    return found


def print_cpu(found: dict, args) -> None:
    print(f"\nCPU: {torch.get_num_threads()} torch threads, batch {args.batch_size}, {args.batches} batches per "
          f"figure, {args.rounds} rounds; median (min-max)\n")  # fmt: skip
    print("| source | path | host CPU ms / image | images/s | host CPU / per-image |\n|---|---|---:|---:|---:|")
    for source, paths in found.items():
        base = statistics.median(paths["per-image"]["cpu_ms"])
        for path, figures in paths.items():
            ratio = statistics.median(figures["cpu_ms"]) / base
            print(f"| {source} | {path} | {spread(figures['cpu_ms'])} | {spread(figures['images_per_s'])} | "
                  f"{ratio:.3f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=640, help="training images written (default 640)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=4, help="batches per figure (default 4)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="keep the images, store and results.json here (default: a temp dir)")
    args = parser.parse_args(argv)
    with sources(args.out, args.images) as (out, specs):
        report = {"torch": torch.__version__, "cpu": cpu_figures(specs, args)}
        print_cpu(report["cpu"], args)
        return finish(report, out)


if __name__ == "__main__":
    sys.exit(main())
