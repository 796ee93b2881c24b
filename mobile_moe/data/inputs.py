"""How a training batch reaches the model (train --input-pipeline):

    workers   each image decoded and augmented in the DataLoader's worker processes (augment.train_transform,
              torchvision's per-image pipeline); the batch's MixUp/CutMix on the training device
    crop      the workers decode, crop (RandomResizedCrop) and flip each image straight to S x S uint8 (crop.py); the
              rest (RandAugment with each image's own draws, normalisation, erasing, MixUp/CutMix) is one fixed-shape
              graph on the training device (batch_graph.py), compiled once on CUDA: FFCV's route
    device    workers only decode (or, for files a GPU decodes, read bytes: decode.py); the uint8 batch is padded into
              one canvas and augmented on the training device, each image with its own draws (batch_augment.py)

`auto` resolves to crop when the recipe augments at random, on any device (`resolve` says what it measured), else to
workers. Either way a batch is (images (B, 3, S, S) normalised float on the device, class targets (B, C)).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from mobile_moe import preprocess
from mobile_moe.data import augment, batch_augment, batch_graph, crop, decode
from mobile_moe.data.augment import Augmentation
from mobile_moe.data.datasets import Data, materialized


def resolve(choice: str, aug: Augmentation) -> str:
    """`auto` -> the pipeline this recipe trains fastest with; a named one stays as it is. Where the recipe draws at
    random, crop: on 2 AMD EPYC cores an epoch ran 2.07x the per-image pipeline's rate from a store of 256 px JPEGs at
    224 px and 1.55x on Fashion-MNIST at 32 px (benchmarks/input_pipeline.results.md); on CUDA it is the one whose
    input keeps up with a compiled step. Where nothing is drawn, workers: the images are augmented once."""
    if choice != "auto":
        return choice
    return "crop" if augment.draws_at_random(aug) else "workers"


def cost_note(pipeline: str, device: torch.device) -> str | None:
    """The device pipeline on a CPU augments each batch in the training process, after the workers' decode: it was
    2.3x slower than `workers` on 2 AMD EPYC cores, so choosing it there is said."""
    if pipeline != "device" or device.type == "cuda":
        return None
    return (f"note: --input-pipeline device on {device.type} augments every batch in the training process, not in "
            "the workers: about 2x slower than --input-pipeline workers on a CPU (auto picks crop)")  # fmt: skip


def training_split(data: Data, aug: Augmentation, pipeline: str, device: torch.device) -> Dataset:
    """The training split as the pipeline's loader reads it: augmented float images (workers; computed once when
    nothing is drawn at random), whole batches cropped to S x S (crop), or raw images for the device (uint8, or a
    GPU-decodable JPEG's bytes on CUDA)."""
    if pipeline == "crop":
        raw = data.raw_split("train")
        eval_crop = functools.partial(eval_crops, record=data.eval_resize, image_size=data.image_size)
        source = decode.encoded_split(raw)
        return crop.CroppedSplit(source or raw, aug, image_size=data.image_size, eval_crop=eval_crop,
                                 device_jpegs=decodes_jpegs_on_device(source, device))  # fmt: skip
    if pipeline == "device":
        limit = decode.source_side_limit(aug.crop_scale, data.image_size)
        source = decode.encoded_split(data.raw_split("train")) if device.type == "cuda" else None
        return decode.RawImages(source, limit) if source is not None else data.split("train", decode.Fitted(limit))
    split = data.split("train", augment.train_transform(aug, data))
    return split if augment.draws_at_random(aug) else materialized(split)


def decodes_jpegs_on_device(source, device: torch.device) -> bool:
    """Whether the crop pipeline leaves a source's JPEGs to the device's decoder: an image folder's, on CUDA. A
    full-size photo costs a CPU core ~3 ms or more to decode (a folder's workers bound the epoch); a packed store's
    256 px JPEGs ~0.3 ms (one core crops ~1,800 a second), so the workers keep those."""
    return device.type == "cuda" and isinstance(source, decode.FolderFiles)


def collate(pipeline: str):
    """The loader's collate_fn: torch's default for augmented images, decode.collate for raw ones, and for cropped
    batches none (the split reads a whole batch)."""
    return {"device": decode.collate, "crop": crop.single}.get(pipeline)


@dataclass
class WorkerBatches:
    """Batches augmented per image in the workers: moved to the device, mixed by torchvision's MixUp/CutMix."""

    num_classes: int
    device: torch.device
    mixer: object | None
    refused_files: int = 0  # nothing is decoded on the device

    def batch(self, loader_batch, key: batch_augment.StepKey) -> tuple[Tensor, Tensor]:
        images, labels = loader_batch
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        return augment.class_targets(images, labels, self.num_classes, self.mixer)


class DeviceBatches:
    """Raw batches decoded (where the workers left bytes) and augmented on the device, drawn from `key`."""

    def __init__(self, aug: Augmentation, data: Data, device: torch.device):
        self.aug, self.image_size, self.eval_resize, self.device = aug, data.image_size, data.eval_resize, device
        self.augment = batch_augment.BatchAugment(
            image_size=data.image_size, mean=data.mean, std=data.std, num_classes=data.num_classes, device=device
        )
        self.refused_files = 0  # JPEGs the device's decoder refused, decoded on the host (decode.decode_jpegs)

    def batch(self, loader_batch: decode.RawBatch, key: batch_augment.StepKey) -> tuple[Tensor, Tensor]:
        canvas, sizes, refused = decode.on_device(loader_batch, self.device)
        self.refused_files += refused
        host_sizes = loader_batch.sizes.numpy()
        eval_crop = eval_crops(host_sizes, self.eval_resize, self.image_size)
        draws = batch_augment.draw(self.aug, host_sizes, image_size=self.image_size, key=key, eval_crop=eval_crop)
        return self.augment.apply(canvas, sizes, draws, loader_batch.labels)


class CropBatches:
    """Batches cropped in the workers (crop.CroppedBatch), through the fixed-shape graph on the device: compiled
    once where it runs on CUDA (its shapes never change, so no batch recompiles it)."""

    def __init__(self, data: Data, device: torch.device, *, compile_graph: bool):
        graph = batch_graph.BatchGraph(mean=data.mean, std=data.std, num_classes=data.num_classes,
                                       fixed_shape=compile_graph).to(device)  # fmt: skip
        self.graph = torch.compile(graph, fullgraph=True, dynamic=False) if compile_graph else graph
        self.device = device
        self.refused_files = 0  # JPEGs the device's decoder refused, decoded on the host (decode.decode_jpegs)

    def batch(self, loader_batch: crop.CroppedBatch, key: batch_augment.StepKey) -> tuple[Tensor, Tensor]:
        params = loader_batch.params.to(self.device)
        images, refused = crop.on_device(loader_batch, self.device)
        self.refused_files += refused
        labels = loader_batch.labels.to(self.device, non_blocking=True)
        args = (images, labels, params.theta, params.colour, params.factor, params.erase, params.mix)
        if self.device.type == "cuda":
            return self.graph(*args)
        # On a host the graph works image by image (BatchGraph._per_image): an image's ops are too small to share
        # between threads (on 2 cores, 2 threads took 1.2x the time of one), and the batches are prepared on the
        # step's own thread (data/ahead.py), so the step gets its threads back before it runs.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self.graph(*args)
        finally:
            torch.set_num_threads(threads)


def eval_crops(sizes: np.ndarray, record: dict, image_size: int) -> np.ndarray:
    """(B, 4) top, left, height, width in source pixels of the region the eval resize policy shows at S x S: the
    whole image (stretch), or the centre square that resize-center-crop keeps."""
    heights, widths = sizes[:, 0].astype(np.float64), sizes[:, 1].astype(np.float64)
    if record["policy"] != preprocess.RESIZE_CENTER_CROP:
        return np.stack([np.zeros_like(heights), np.zeros_like(widths), heights, widths], 1)
    side = np.minimum(heights, widths) * record["crop_to"] / record["resize_to"]  # the crop, in source pixels
    return np.stack([(heights - side) / 2, (widths - side) / 2, side, side], 1)


def batches(pipeline: str, aug: Augmentation, data: Data, device: torch.device, mixer):
    """What turns the loader's batches into (images, targets) on `device` for `pipeline`."""
    if pipeline == "crop":
        return CropBatches(data, device, compile_graph=device.type == "cuda")
    return DeviceBatches(aug, data, device) if pipeline == "device" else WorkerBatches(data.num_classes, device, mixer)
