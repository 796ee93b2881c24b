"""The deit recipe's input path: per image on the CPU (`--input-pipeline workers`), decoded and cropped in the workers
with one graph after (`crop`), and per batch on the training device (`device`), from an image folder and from its
packed store, measured in one run.

    python benchmarks/input_pipeline.py                       # CPU figures: 640 ImageNet-sized images, 3 rounds
    python benchmarks/input_pipeline.py --images 2000 --rounds 5 --out bench-input
    python benchmarks/input_pipeline.py --gpu                 # the GPU figures instead (make gpu-check runs it first)

It writes its own ImageNet-sized images (500 x 375, about 125 KB as JPEG, ImageNet's average), 10 classes, with
progressive (8%), CMYK (4%) and grayscale (4%) JPEGs and PNGs (4%) among them (MIXES["harsh"]; with --gpu also a
folder of ImageNet's mix, 98% baseline JPEG), then packs them (`mobile-moe pack`, --max-side 256). Figures, each the
median of --rounds with the spread (min-max):

  host CPU s / image    process CPU time per training image of what the host does (workers=0, so it is all in this
                        process): per-image = decode + the whole torchvision pipeline; device-fed = what the host does
                        when a GPU augments: read bytes (GPU-decodable JPEGs) or decode (the rest), pad, draw
  device images/s       the batched pipeline itself on this machine's device (here the CPU: decode in the loader,
                        augment with batch_augment on the CPU), against the per-image path's images/s
  crop                  one crop worker's images/s (one core); the crop graph alone (host ms, device ms and kernels
                        or operators per batch); epoch 2 of a small ViT at 224 from the store, crop against workers
  accuracy              (--accuracy SPEC) test top-1 of a small ViT trained with the deit recipe per seed: workers,
                        crop and device pipelines, and workers from SPEC packed at --accuracy-max-side
  GPU end to end        (--gpu) the crop graph alone on batches of 256; a 2-epoch training run per model (DeiT-Ti/16
                        224, bf16, compiled, batch 256, a worker per core, --input-pipeline crop): epoch 2's images/s
                        over the step alone on tensors already on the device (benchmarks/train_step.py's measurement),
                        from each folder and from the store; then the loader alone against the loader with the graph
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from mobile_moe.data import augment, decode, inputs, store
from mobile_moe.data.batch_augment import StepKey, draw
from mobile_moe.data.datasets import open_data
from mobile_moe.devices import usable_cores
from mobile_moe.training import recipes

# Each kind's share of the folder's images: this benchmark's harsh mix, and one like ImageNet's (about 98% baseline
# JPEG; a few thousand grayscale and 22 CMYK files in 1.28M)
MIXES = {
    "harsh": {"baseline": 0.80, "progressive": 0.08, "cmyk": 0.04, "grayscale": 0.04, "png": 0.04},
    "imagenet": {"baseline": 0.98, "progressive": 0.01, "grayscale": 0.01},
}
CLASSES = 10
SIZE = (375, 500)  # ImageNet's average image, (height, width)


def photo(rng: np.random.Generator) -> Image.Image:
    """Photo-like content: smooth colour fields plus fine detail, about 125 KB as a quality-90 JPEG at 500 x 375."""
    coarse = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize(SIZE[::-1], Image.Resampling.BICUBIC), dtype=np.float32)
    detail = rng.normal(0, 16, (*SIZE, 3))
    return Image.fromarray(np.clip(smooth + detail, 0, 255).astype(np.uint8))


def save(image: Image.Image, path: Path, kind: str) -> None:
    if kind == "png":
        image.save(path.with_suffix(".png"))
    elif kind == "cmyk":
        image.convert("CMYK").save(path, quality=90)
    elif kind == "grayscale":
        image.convert("L").save(path, quality=90)
    else:
        image.save(path, quality=90, progressive=kind == "progressive")


def write_image(task: tuple[Path, int, str]) -> None:
    """Image `index` of the folder: its content and kind (from MIXES[mix]) drawn from its own index, so any process
    may write it."""
    folder, index, mix = task
    rng = np.random.default_rng(index)
    kinds = MIXES[mix]
    kind = list(kinds)[rng.choice(len(kinds), p=list(kinds.values()))]
    save(photo(rng), folder / f"c{index % CLASSES}" / f"{index}.jpg", kind)


def write_folder(root: Path, count: int, mix: str = "harsh") -> Path:
    """ROOT/{train,val}/<class>/<i>.jpg: `count` training images of MIXES[mix] and a tenth as many for validation,
    written on every core."""
    from multiprocessing import Pool

    tasks = []
    for split, total, first in (("train", count, 0), ("val", max(count // 10, 2 * CLASSES), count)):
        for name in range(CLASSES):
            (root / split / f"c{name}").mkdir(parents=True, exist_ok=True)
        tasks += [(root / split, index, mix) for index in range(first, first + total)]
    with Pool(usable_cores()) as pool:
        pool.map(write_image, tasks, chunksize=16)
    return root


def cpu_seconds(batches, count: int, handle) -> tuple[float, float]:
    """(process CPU s per image, wall images/s) of `handle`-ing `count` batches."""
    cpu, wall = time.process_time(), time.perf_counter()
    images = sum(handle(batch, step) for step, batch in enumerate(islice(batches, count)))
    return (time.process_time() - cpu) / images, images / (time.perf_counter() - wall)


def per_image(data, aug, batch_size: int, count: int):
    """Today's path in the loader: decode + torchvision's per-image pipeline + MixUp/CutMix on the batch."""
    split = inputs.training_split(data, aug, "workers", torch.device("cpu"))
    mixer = augment.batch_mixer(aug, data.num_classes)
    loader = DataLoader(split, batch_size=batch_size, shuffle=True, num_workers=0, drop_last=True)
    to_model = inputs.WorkerBatches(data.num_classes, torch.device("cpu"), mixer)
    return cpu_seconds(loader, count, lambda batch, step: len(to_model.batch(batch, StepKey(0, 0, 0, step))[0]))


def device_fed_host(data, aug, batch_size: int, count: int):
    """The host's share when a GPU decodes and augments: read bytes or decode the kinds a GPU cannot, pad, draw."""
    raw = inputs.training_split(data, aug, "device", torch.device("cuda"))  # what a GPU's loader reads; no CUDA call
    loader = DataLoader(raw, batch_size=batch_size, shuffle=True, num_workers=0, drop_last=True,
                        collate_fn=inputs.collate("device"))  # fmt: skip

    def host_part(batch: decode.RawBatch, step: int) -> int:
        sizes = batch.sizes.numpy()
        crops = inputs.eval_crops(sizes, data.eval_resize, data.image_size)
        draw(aug, sizes, image_size=data.image_size, key=StepKey(0, 0, 0, step), eval_crop=crops)
        return len(sizes)

    return cpu_seconds(loader, count, host_part)


def on_this_device(data, aug, batch_size: int, count: int):
    """The whole device pipeline where no GPU is: decode in the loader, batch_augment on the CPU."""
    device = torch.device("cpu")
    split = inputs.training_split(data, aug, "device", device)
    loader = DataLoader(split, batch_size=batch_size, shuffle=True, num_workers=0, drop_last=True,
                        collate_fn=inputs.collate("device"))  # fmt: skip
    to_model = inputs.DeviceBatches(aug, data, device)
    return cpu_seconds(loader, count, lambda batch, step: len(to_model.batch(batch, StepKey(0, 0, 0, step))[0]))


PATHS = {"per-image": per_image, "device-fed host": device_fed_host, "batched on the CPU": on_this_device}


def cpu_figures(specs: dict[str, str], args) -> dict:
    """{source: {path: {"cpu_ms": [...], "images_per_s": [...]}}}, the paths taking turns in every round."""
    aug = recipes.deit().augmentation
    found = {source: {path: {"cpu_ms": [], "images_per_s": []} for path in PATHS} for source in specs}
    for _ in range(args.rounds):
        for source, spec in specs.items():
            data = open_data(spec, args.image_size)
            for path, measure in PATHS.items():
                seconds, rate = measure(data, aug, args.batch_size, args.batches)
                found[source][path]["cpu_ms"].append(seconds * 1e3)
                found[source][path]["images_per_s"].append(rate)
    return found


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


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


def crop_stages(specs: dict[str, str], device: torch.device, batch_size: int = 256) -> dict:
    """{source: {stage: images/s, "share decoded on the device": ...}} of --input-pipeline crop's halves, so an epoch
    below the step names its cause: the loader alone (usable-cores workers decoding and cropping, into pinned memory
    on CUDA: the decode capacity), then the loader with each batch finished on `device` (a folder's JPEGs decoded and
    cropped there, crop.on_device) and through the graph (synchronised per batch; the host ms of that call, its median
    over batches, timed before the synchronisation), each in the steady state. A folder's loader is also timed
    with its workers decoding every image (device_jpegs off: what a folder feeds without the GPU's decoder)."""
    from mobile_moe.training.distributed import Placement
    from mobile_moe.training.train import make_loader

    recipe = recipes.deit().replace(batch_size=batch_size, workers=usable_cores(), device=device.type,
                                    input_pipeline="crop")  # fmt: skip
    found = {}
    for source, spec in specs.items():
        data = open_data(spec, 224)
        split = inputs.training_split(data, recipe.augmentation, "crop", device)
        to_model = inputs.CropBatches(data, device, compile_graph=device.type == "cuda")
        stages, device_jpegs = {}, split.device_jpegs
        plan = [("loader", device_jpegs), ("loader + graph", device_jpegs)]
        plan += [("loader, the workers decoding every image", False)] if device_jpegs else []
        for stage, decode_on_device in plan:
            split.device_jpegs = decode_on_device  # a new loader's workers take the split as it is now
            loader, _ = make_loader(split, recipe, Placement(0, 1, device), inputs.collate("crop"))
            # timed: the second epoch (workers persist, as in training) in its steady state. Batch k + W comes from
            # the worker that made batch k (W workers: DataLoader deals batches round-robin, torch/utils/data/
            # dataloader.py, _try_put_index), so W batches over the median time from batch k to k + W is the rate
            # of W workers decoding side by side, or of whatever consumes the batches where that is slower; an
            # epoch's images over its time also counted its first round, which the W workers start together and
            # which ends at once: on 2 batches against 5 an epoch, 1.6x apart on the same folder of photographs
            for _ in range(2):
                done, images, on_device, host = [], 0, 0, []
                for step, batch in enumerate(loader):
                    if stage == "loader + graph":
                        begin = time.perf_counter()
                        to_model.batch(batch, StepKey(0, 0, 0, step))
                        host.append(time.perf_counter() - begin)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                    done.append(time.perf_counter())
                    images += len(batch.labels)
                    on_device += len(batch.jpegs.rows) if batch.jpegs is not None else 0
            workers = recipe.workers
            if len(done) <= workers:
                raise SystemExit(f"crop_stages: {source} makes {len(done)} batches of {batch_size} an epoch for "
                                 f"{workers} workers; the steady state needs more than {workers}")  # fmt: skip
            round_s = statistics.median(later - first for first, later in zip(done, done[workers:], strict=False))
            stages[stage] = workers * batch_size / round_s
            stages.setdefault("share decoded on the device", on_device / images)
            if host:  # what the thread preparing batches holds of the training process's host time, a batch
                stages["loader + graph, host ms / batch"] = 1e3 * statistics.median(host)
        found[source] = stages
        print(f"{source}: " + ", ".join(f"{name} {value:.3g}" for name, value in stages.items()), flush=True)
    return found


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
    from mobile_moe.registry import make_config
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


def gpu_figures(specs: dict[str, str], out: Path, args) -> dict:
    """Epoch 2's images/s of a real training run after its first step (steady_images_per_s: the workers' start left
    out, as for the step alone, whose warm-up is left out) over the step alone, per model and source; the whole
    epoch's too."""
    sys.path.insert(0, str(Path(__file__).parent))
    import train_step

    from mobile_moe.registry import make_config
    from mobile_moe.training.run_dir import read_metrics
    from mobile_moe.training.train import train

    step_args = train_step.parse_args(["--models", *args.gpu_models, "--num-classes", str(CLASSES)],
                                      device="cuda", size="deit-ti", patch=16, batch_size=256, steps=30, warmup=5,
                                      compile=True)  # fmt: skip
    steps_alone = train_step.measure(step_args, torch.device("cuda"))[0]
    alone, found = steps_alone.get("compiled", {}), {}  # measure printed why, where compiling failed
    print("step alone, img/s eager / compiled (graph breaks, first step s): " + ", ".join(
        f"{name} {steps_alone['eager'][name]['images_per_s']:.0f} / {row['images_per_s']:.0f} "
        f"({row['graph_breaks']}, {row['first_step_s']:.0f})" for name, row in alone.items()), flush=True)  # fmt: skip
    for model in args.gpu_models:
        extra = {"num_experts": 10, "moe_layers": 2} if model == "mobile-vmoe" else {}
        config = make_config(model, "deit-ti", patch_size=16, image_size=224, num_classes=CLASSES, **extra)
        recipe = recipes.deit().replace(epochs=2, batch_size=256, workers=usable_cores(), compile=True, device="cuda",
                                        input_pipeline="crop", warmup_epochs=0.5)  # fmt: skip
        for source, spec in specs.items():
            name = f"{model} {source}"
            run = reported(name, train, config, recipe, spec, "random" if extra else None, out / f"{model}-{source}",
                           verbose=False)  # fmt: skip
            row = run if isinstance(run, dict) else read_metrics(run)[-1]  # a dict: the error reported
            found[name] = row if "error" in row else {
                "epoch_images_per_s": row["steady_images_per_s"], "whole_epoch_images_per_s": row["images_per_s"],
                "input_wait": row["input_wait"], "epoch_parts": shares(row.get("epoch_parts")),
                "step_alone_images_per_s": alone.get(model, {}).get("images_per_s")}  # fmt: skip
            print(f"{name}: {json.dumps(found[name])}", flush=True)
    return found


def shares(parts: dict | None) -> dict | None:
    """An epoch's parts (training/attribution.py) as shares of its steady window, the window in seconds: what tells
    the next fix (waiting for input, the step's launches on or off the CPU, the loop's own work, the GPU's busy
    share, the thread preparing batches, the pin-memory thread)."""
    if parts is None:
        return None
    window = parts["window_s"]
    return {"window_s": window} | {name.removesuffix("_s"): None if value is None else round(value / window, 4)
                                   for name, value in parts.items() if name != "window_s"}  # fmt: skip


def reported(what: str, measure, *args, **kwargs):
    """measure(*args, **kwargs), or {"error": its first line} where it raises, the traceback on stderr: a GPU call has
    one chance, and the figures after a failed one still run."""
    try:
        return measure(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - reported in the results, and the run goes on
        from train_step import error_line  # this folder is on sys.path: the script's own, or its importer's

        traceback.print_exc()
        line = error_line(error)
        print(f"{what}: failed: {line}", file=sys.stderr, flush=True)
        return {"error": line}


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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=640, help="training images written (default 640)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=4, help="batches per CPU figure (default 4)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--accuracy", metavar="SPEC", help="also train per seed on SPEC (e.g. fashion-mnist:...)")
    parser.add_argument("--accuracy-max-side", type=int, default=16, help="the store's --max-side for --accuracy")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10, help="epochs per --accuracy run (default 10)")
    parser.add_argument("--gpu", action="store_true", help="also train end to end on the GPU (--images 12800 or more)")
    parser.add_argument("--gpu-models", nargs="+", default=["mobile-vmoe"], choices=["vit", "mobile-vmoe"],
                        help="the models --gpu trains (default: mobile-vmoe, the issue's goal)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="keep the images, store and results.json here (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu: no CUDA device here")
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        folder = write_folder(out / "folder", args.images)
        packed = store.pack(open_data(f"imagefolder:{folder}", 256), out / "store", max_side=256)
        specs = {"image folder": f"imagefolder:{folder}", "packed store": f"packed:{packed}"}
        if args.gpu:  # a folder like ImageNet's beside the harsh one: what a real folder feeds
            imagenet = write_folder(out / "folder-imagenet-mix", args.images, mix="imagenet")
            specs = {"image folder, ImageNet's mix": f"imagefolder:{imagenet}", **specs}
        report = {"torch": torch.__version__}
        if not args.gpu:  # a GPU machine's call (make gpu-check) spends its minutes on the GPU figures
            report["cpu"] = cpu_figures(specs, args)
            print_cpu(report["cpu"], args)
            report["crop worker images/s"] = crop_worker_rate(specs["packed store"], args)
            print(f"one crop worker, store to {args.image_size} px: {spread(report['crop worker images/s'])} images/s")
            report["cpu graph"] = graph_figures(torch.device("cpu"), args.batch_size, args.image_size)
            report["cpu epoch images/s"] = epochs = cpu_epochs(specs["packed store"], out, args)
            ratio = [crop / workers for crop, workers in zip(epochs["crop"], epochs["workers"], strict=True)]
            print(
                f"epoch 2 from the store, {usable_cores()} workers: workers {spread(epochs['workers'])}, crop "
                f"{spread(epochs['crop'])} images/s; crop / workers {spread(ratio)}"
            )
        if args.accuracy:
            report["accuracy"] = accuracy(args.accuracy, out, args)
            print_accuracy(report["accuracy"])
        if args.gpu:
            cuda = torch.device("cuda")
            report["gpu graph"] = reported("the crop graph", graph_figures, cuda, 256, 224)
            report["gpu"] = {"device": torch.cuda.get_device_name(), **gpu_figures(specs, out, args)}
            report["gpu stages"] = reported("the crop's stages", crop_stages, specs, cuda)
            print(json.dumps(report["gpu"], indent=1))
            measured = {name: row for name, row in report["gpu"].items() if name != "device" and "error" not in row}
            ratios = [f"{name} {row['epoch_images_per_s'] / row['step_alone_images_per_s']:.2f}"
                      for name, row in measured.items() if row["step_alone_images_per_s"]]  # fmt: skip
            print("epoch / step-alone images/s: " + ", ".join(ratios))
        (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def failures(found) -> list[str]:
    """The error lines anywhere in a report (reported's)."""
    if not isinstance(found, dict):
        return []
    return [found["error"]] if "error" in found else [line for value in found.values() for line in failures(value)]


if __name__ == "__main__":
    failed = failures(main())
    if failed:  # the last line, which make gpu-check's table shows
        print(f"{len(failed)} figure(s) failed: {'; '.join(failed)}", file=sys.stderr)
    sys.exit(1 if failed else 0)
