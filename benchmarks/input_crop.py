"""--input-pipeline crop on this machine's CPU (FFCV's route: decode and crop in the workers, one graph after), against
the per-image path, from a packed store of ImageNet-sized photographs:

    python benchmarks/input_crop.py                            # 640 images, 3 rounds
    python benchmarks/input_crop.py --images 1280 --rounds 3 --out bench-crop

  one crop worker       images/s of one worker (one thread) decoding, cropping and flipping store images to S x S
  the crop graph        on this CPU, batches already in memory: host ms and operators per batch
  epoch 2               a small ViT at S px trained with the deit recipe from the store, a worker per usable core:
                        crop against per image (workers), images/s, and where each epoch's time went (its parts)

Each figure the median of --rounds with the spread (min-max). input_gpu_epoch.py measures the same on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from input_bench import CLASSES, finish, shares, sources, spread  # noqa: E402

from mobile_moe.data import inputs  # noqa: E402
from mobile_moe.data.batch_augment import StepKey, draw  # noqa: E402
from mobile_moe.data.datasets import open_data  # noqa: E402
from mobile_moe.training import recipes  # noqa: E402
from mobile_moe.utils.devices import usable_cores  # noqa: E402


def graph_figures(device: torch.device, batch_size: int, image_size: int, batches: int = 20) -> dict:
    """The crop pipeline's graph on `device`, on batches already in (pinned) memory with the deit recipe's draws:
    host ms per batch in the training process (perf_counter around CropBatches.batch, which returns without waiting
    for the device), device ms per batch (CUDA events), and the device kernels (CPU: operators) per batch, from
    torch.profiler, after the compile and two warm batches."""
    from torch.profiler import ProfilerActivity, profile

    from mobile_moe.data import batch_graph, crop
    from mobile_moe.data.datasets import Data
    from mobile_moe.training import host_memory

    aug = recipes.deit().augmentation
    data = Data("bench", image_size, [str(c) for c in range(CLASSES)], (0.5,) * 3, (0.25,) * 3, {})
    to_model = inputs.CropBatches(data, device, compile_graph=device.type == "cuda")
    if device.type == "cpu":  # as CPU training runs it: each batch's tensors reuse the last one's pages
        host_memory.keep_freed_blocks(host_memory.float_batch_bytes(batch_size, image_size))
    sizes = np.full((batch_size, 2), 256)
    held = []
    for step in range(batches + 2):
        draws = draw(aug, sizes, image_size=image_size, key=StepKey(0, 0, 0, step), eval_crop=None)
        images = torch.randint(0, 256, (batch_size, image_size, image_size, 3), dtype=torch.uint8)
        batch = crop.CroppedBatch(images, torch.arange(batch_size) % CLASSES, batch_graph.params(draws, image_size),
                                  StepKey(0, 0, 0, step))  # fmt: skip
        held.append(batch.pin_memory() if device.type == "cuda" else batch)
    cuda = device.type == "cuda"
    for batch in held[:2]:
        to_model.batch(batch, batch.key)
    if cuda:
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    host = time.perf_counter()
    for batch in held[2:]:
        to_model.batch(batch, batch.key)
    host_ms = 1e3 * (time.perf_counter() - host) / batches
    if cuda:
        end.record()
        torch.cuda.synchronize()
    found = {"host_ms_per_batch": host_ms, "device_ms_per_batch": begin.elapsed_time(end) / batches if cuda else None}
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as profiled:
        for batch in held[2:6]:
            to_model.batch(batch, batch.key)
        if cuda:
            torch.cuda.synchronize()
    events = profiled.events()
    kernels = [e for e in events if cuda and e.device_type.name == "CUDA"]
    found["kernels_per_batch" if cuda else "operators_per_batch"] = (
        len(kernels) if cuda else sum(e.name.startswith("aten::") for e in events)) / 4  # fmt: skip
    print(f"crop graph on {device}, batch {batch_size}: {json.dumps(found)}", flush=True)
    return found


def crop_worker_rate(spec: str, args) -> list[float]:
    """Images/s of one worker (this process, one thread) decoding, cropping and flipping store images to S x S
    (crop.CroppedSplit, --input-pipeline crop's worker half), per round."""
    data = open_data(spec, args.image_size)
    split = inputs.training_split(data, recipes.deit().augmentation, "crop", torch.device("cpu"))
    threads, rates = torch.get_num_threads(), []
    torch.set_num_threads(1)
    try:
        for round_ in range(args.rounds):
            start, done = time.perf_counter(), 0
            for step in range(len(split) // args.batch_size):
                indices = range(step * args.batch_size, (step + 1) * args.batch_size)
                split.__getitems__([(0, round_, 0, step, index) for index in indices])
                done += args.batch_size
            rates.append(done / (time.perf_counter() - start))
    finally:
        torch.set_num_threads(threads)
    return rates


def cpu_epochs(spec: str, out: Path, args) -> dict[str, list[float]]:
    """{pipeline: images/s of epoch 2 per round}: a tiny ViT at S px (4 x 64, patch 32: the step is small, the input
    path is what is measured) trained with the deit recipe on this CPU, workers = usable cores, per image (workers)
    against crop. The whole epoch's rate (images_per_s), as the results before steady_images_per_s: the per-image
    path is slower than its loader there, and its epoch's last batches, which the workers finished ahead, come faster
    than its pace, which a window after the start alone leaves in (SteadyWindow)."""
    from mobile_moe.models.registry import make_config
    from mobile_moe.training.run_dir import read_metrics
    from mobile_moe.training.train import train

    config = make_config("vit", "4x64", patch_size=32, image_size=args.image_size, num_classes=CLASSES)
    found = {"workers": [], "crop": []}
    for round_ in range(args.rounds):
        for pipeline in found:
            recipe = recipes.deit().replace(epochs=2, batch_size=args.batch_size, workers=usable_cores(), device="cpu",
                                            input_pipeline=pipeline, warmup_epochs=0.5)  # fmt: skip
            run = train(config, recipe, spec, None, out / f"cpu-epoch-{pipeline}-{round_}", verbose=False)
            row = read_metrics(run)[-1]
            found[pipeline].append(row["images_per_s"])
            print(f"cpu epoch {pipeline} round {round_}: parts {json.dumps(shares(row.get('epoch_parts')))}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=640, help="training images written (default 640)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="keep the images, store and results.json here (default: a temp dir)")
    args = parser.parse_args(argv)
    with sources(args.out, args.images) as (out, specs):
        report = {"torch": torch.__version__, "crop worker images/s": crop_worker_rate(specs["packed store"], args)}
        print(f"one crop worker, store to {args.image_size} px: {spread(report['crop worker images/s'])} images/s")
        report["cpu graph"] = graph_figures(torch.device("cpu"), args.batch_size, args.image_size)
        report["cpu epoch images/s"] = epochs = cpu_epochs(specs["packed store"], out, args)
        ratio = [crop / workers for crop, workers in zip(epochs["crop"], epochs["workers"], strict=True)]
        print(
            f"epoch 2 from the store, {usable_cores()} workers: workers {spread(epochs['workers'])}, crop "
            f"{spread(epochs['crop'])} images/s; crop / workers {spread(ratio)}"
        )
        return finish(report, out)


if __name__ == "__main__":
    sys.exit(main())
