"""`train --input-pipeline crop` (mobile_moe/data/crop.py, batch_graph.py) against torchvision's per-image ops fed the
same draws: the worker's crop and flip against resized_crop on the full decode, each RandAugment op against
v2.RandAugment's own, erasing against F.erase, MixUp and CutMix against v2.MixUp and v2.CutMix; the same batches
whatever --workers is; and one compiled graph for every batch."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from photos import photographs
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from mobile_moe.data import batch_augment, batch_graph, crop
from mobile_moe.data.augment import Augmentation
from mobile_moe.data.batch_augment import OP_NAMES, StepKey
from mobile_moe.data.image_files import image_from_bytes

DEIT = Augmentation(crop_scale=0.08, hflip=True, randaugment_ops=2, randaugment_magnitude=9, mixup_alpha=0.8,
                    cutmix_alpha=1.0, random_erasing=0.25)  # fmt: skip


class Encoded:
    """A split of encoded images, as a store or an image folder offers them."""

    def __init__(self, blobs: list[bytes]):
        self.blobs, self.targets = blobs, [index % 3 for index in range(len(blobs))]

    def __len__(self) -> int:
        return len(self.blobs)

    def encoded(self, index: int) -> bytes:
        return self.blobs[index]

    def name(self, index: int) -> str:
        return f"image {index}"


def jpegs(side: int, count: int, **save) -> list[bytes]:
    """`count` JPEGs of the test photographs, their longer side `side` pixels (`save`: more of PIL's JPEG options)."""
    blobs = []
    for index in range(count):
        photo = photographs()[index % 3]
        scale = side / max(photo.size)
        image = photo.resize((round(photo.width * scale), round(photo.height * scale)), Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90, **save)
        blobs.append(buffer.getvalue())
    return blobs


def items(step: int, indices) -> list[tuple[int, int, int, int, int]]:
    return [(0, 0, 0, step, index) for index in indices]


@pytest.mark.parametrize("side, size, psnr", [(256, 224, 50.0), (1600, 64, 28.0)], ids=["store", "draft"])
def test_the_worker_crop_is_torchvision_resized_crop_and_flip(side, size, psnr):
    """Each image of a batch equals torchvision's antialiased resized_crop (and hflip) of the whole decode with the
    batch's draws: exactly where the JPEG decodes whole (a store's 256 px to 224), within 28 dB where it decodes at
    reduced scale (a 1600 px photo to 64: its crop spans 2 to 8 times 64 pixels, so libjpeg's DCT scaling shrinks it
    first)."""
    blobs = jpegs(side, 12)
    split = crop.CroppedSplit(Encoded(blobs), DEIT, image_size=size, eval_crop=None)
    batch = split.__getitems__(items(5, range(12)))
    sizes = np.array([image_from_bytes(blob, "x").size[::-1] for blob in blobs])
    draws = batch_augment.draw(DEIT, sizes, image_size=size, key=StepKey(0, 0, 0, 5), eval_crop=None)
    assert draws.flip.any() and not draws.flip.all()
    for index, blob in enumerate(blobs):
        top, left, height, width = (int(v) for v in draws.crop[index])
        whole = F.pil_to_tensor(image_from_bytes(blob, "x"))
        expected = F.resized_crop(whole, top, left, height, width, [size, size])
        expected = F.horizontal_flip(expected) if draws.flip[index] else expected
        difference = batch.images[index].permute(2, 0, 1).float() - expected.float()
        assert 10 * np.log10(255**2 / max(difference.pow(2).mean().item(), 1e-12)) > psnr, index
        assert side > 256 or difference.abs().max() == 0, index
    assert batch.labels.tolist() == [index % 3 for index in range(12)]


def test_the_same_batches_whatever_the_workers():
    """The draws are the step's (seed, epoch, rank, step), not a worker's: 0 and 2 workers give equal batches."""
    split = crop.CroppedSplit(Encoded(jpegs(96, 16)), DEIT, image_size=32, eval_crop=None)

    def epoch(workers: int) -> list[crop.CroppedBatch]:
        order = DistributedSampler(split, num_replicas=1, rank=0, shuffle=True, seed=7, drop_last=True)
        sampler = crop.KeyedBatches(order, 4, seed=7, rank=0)
        sampler.set_epoch(3)
        loader = DataLoader(split, batch_sampler=sampler, num_workers=workers, collate_fn=crop.single)
        return list(loader)

    alone, shared = epoch(0), epoch(2)
    assert [b.key for b in alone] == [StepKey(7, 3, 0, step) for step in range(4)]
    for one, other in zip(alone, shared, strict=True):
        assert torch.equal(one.images, other.images) and torch.equal(one.labels, other.labels)
        assert torch.equal(one.params.theta, other.params.theta) and torch.equal(one.params.mix, other.params.mix)


def one_op_draws(op: str, count: int, size: int, rng) -> batch_augment.Draws:
    """Draws where every image takes `op` in its one slot, at magnitude 9 with its own sign."""
    ops = np.full((count, 1), OP_NAMES.index(op))
    base = np.array([value(9, size) for *_, value in batch_augment.OPS])[ops]
    signs = np.where(rng.random((count, 1)) < 0.5, -1.0, 1.0) if batch_augment.OPS[ops[0, 0]][2] else 1.0
    empty = np.zeros((count, 4))
    return batch_augment.Draws(empty, np.zeros(count, bool), ops, base * signs, empty, ("none", 1.0, None))


@pytest.mark.parametrize("op", [name for name in OP_NAMES if name != "Identity"])
def test_each_randaugment_op_is_torchvision_on_each_image(op):
    """One slot of the graph, every image drawing `op` with its own sign, against v2.RandAugment's own op on that
    image (uint8, nearest, black fill): equal but where float rounding puts a value at a level's edge and one side
    truncates it a level lower (at most 1 level, on at most 5% of the values: torchvision's blends fuse a multiply
    and an add where the graph rounds twice)."""
    rng = np.random.default_rng(OP_NAMES.index(op))
    count, size = 8, 40
    images = torch.from_numpy(rng.integers(0, 256, (count, 3, size, size), dtype=np.uint8))
    images[:2] = F.pil_to_tensor(photographs()[0].resize((size, size)))  # real pictures, not only noise
    draws = one_op_draws(op, count, size, rng)
    params = batch_graph.params(draws, size)
    x = batch_graph.geometric(images.float(), params.theta[:, 0])
    got = batch_graph.colour(x, params.colour[:, 0], params.factor[:, 0])
    augment = v2.RandAugment(num_ops=1, magnitude=9)
    fill = augment._fill
    for index in range(count):
        magnitude = float(draws.magnitudes[index, 0])
        expected = augment._apply_image_or_video_transform(images[index], op, magnitude, v2.InterpolationMode.NEAREST,
                                                           fill)  # fmt: skip
        difference = (got[index] - expected.float()).abs()
        assert difference.max() <= 1 and (difference > 0).float().mean() <= 0.05, (op, index, magnitude)


@pytest.mark.parametrize("fixed_shape", [True, False], ids=["fixed graph", "image by image"])
def test_the_graph_erases_and_mixes_as_torchvision(fixed_shape):
    """Normalisation, then RandomErasing's box (F.erase with 0) and MixUp or CutMix (v2.MixUp / v2.CutMix's
    transform with the batch's lambda and box) on the same draws: equal to float rounding. A box with its height and
    width swapped, or a CutMix box read as (y, x), would fail here."""
    count, size, classes = 6, 24, 5
    aug = Augmentation(crop_scale=0.5, hflip=False, randaugment_ops=0, randaugment_magnitude=9, mixup_alpha=0.8,
                       cutmix_alpha=1.0, random_erasing=1.0)  # fmt: skip
    graph = batch_graph.BatchGraph(mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), num_classes=classes,
                                   fixed_shape=fixed_shape)  # fmt: skip
    images = torch.randint(0, 256, (count, size, size, 3), dtype=torch.uint8)
    labels = torch.arange(count) % classes
    kinds = set()
    for step in range(12):
        draws = batch_augment.draw(aug, np.full((count, 2), 50), image_size=size, key=StepKey(1, 0, 0, step),
                                   eval_crop=None)  # fmt: skip
        params = batch_graph.params(draws, size)
        got, targets = graph(images, labels, params.theta, params.colour, params.factor, params.erase, params.mix)
        x = F.normalize(images.permute(0, 3, 1, 2).float() / 255, [0.5, 0.4, 0.3], [0.2, 0.25, 0.3])
        erased = [F.erase(image, *map(int, box), v=torch.tensor(0.0)) if box[2] else image
                  for image, box in zip(x, draws.erase, strict=True)]  # fmt: skip
        assert (draws.erase[:, 2] != draws.erase[:, 3]).any()
        one_hot = torch.nn.functional.one_hot(labels, classes).float()
        kind, lam, box = draws.mix
        kinds.add(kind)
        mixer = v2.MixUp(num_classes=classes) if kind == "mixup" else v2.CutMix(num_classes=classes)
        params_tv = {"lam": lam, "box": box, "lam_adjusted": lam, "labels": one_hot, "batch_size": count}
        expected = mixer.transform(torch.stack(erased), params_tv)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(targets, mixer.transform(one_hot, params_tv), rtol=0, atol=1e-6)
    assert kinds == {"mixup", "cutmix"}


def test_one_compiled_graph_serves_every_batch_on_the_thread_that_prepares_them():
    """torch.compile(fullgraph=True, dynamic=False) traces the graph once: batches with other draws (other ops, other
    boxes, MixUp then CutMix) reuse it, and it answers as the eager graph and as the CPU's eager path, which runs each
    op only on the images that drew it. On CUDA it is traced and run on data/ahead.py's thread, not the main one:
    here too."""
    import torch._dynamo

    from mobile_moe.data.ahead import BatchesAhead

    size, count = 16, 4
    graph = batch_graph.BatchGraph(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), num_classes=3)
    grouped = batch_graph.BatchGraph(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), num_classes=3, fixed_shape=False)
    torch._dynamo.reset()
    compiled = torch.compile(graph, fullgraph=True, dynamic=False, backend="eager")
    torch._dynamo.utils.counters.clear()
    images = torch.randint(0, 256, (count, size, size, 3), dtype=torch.uint8)

    def prepare(step: int, _) -> tuple:
        draws = batch_augment.draw(DEIT, np.full((count, 2), 40), image_size=size, key=StepKey(0, 0, 0, step),
                                   eval_crop=None)  # fmt: skip
        params = batch_graph.params(draws, size)
        args = (images, torch.arange(count) % 3, params.theta, params.colour, params.factor, params.erase, params.mix)
        return threading.current_thread(), compiled(*args), graph(*args), grouped(*args)

    with BatchesAhead(range(5), prepare, torch.device("cpu"), in_thread=True) as ahead:
        for thread, *outputs in ahead:
            assert thread is not threading.main_thread()
            for got, expected, subsets in zip(*outputs, strict=True):
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
                torch.testing.assert_close(subsets, expected, rtol=0, atol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["recompiles"]


def test_jpegs_left_to_the_device_are_cropped_there_as_in_the_worker():
    """device_jpegs (an image folder on CUDA): the baseline JPEGs travel as bytes, sized from their headers (so the
    draws are the same), and crop.on_device decodes, crops, resizes and flips them as the worker does; a progressive
    JPEG, which nvJPEG does not take, is cropped in the worker. The CPU as the device: the same batch exactly."""
    blobs = jpegs(96, 6)
    buffer = io.BytesIO()
    photographs()[0].resize((96, 64)).save(buffer, "JPEG", quality=90, progressive=True)
    blobs[3] = buffer.getvalue()
    in_worker = crop.CroppedSplit(Encoded(blobs), DEIT, image_size=64, eval_crop=None).__getitems__(items(2, range(6)))
    split = crop.CroppedSplit(Encoded(blobs), DEIT, image_size=64, eval_crop=None, device_jpegs=True)
    left = split.__getitems__(items(2, range(6)))
    assert left.jpegs.index.tolist() == [0, 1, 2, 4, 5] and left.jpegs.flips.any()
    images, refused = crop.on_device(left, torch.device("cpu"))
    assert refused == 0 and torch.equal(images, in_worker.images) and torch.equal(left.labels, in_worker.labels)
    assert torch.equal(left.params.theta, in_worker.params.theta)


def test_a_device_decode_of_another_size_than_its_header_is_cropped_within_it(monkeypatch):
    """The crops are drawn for the headers' sizes and their pixels computed in the worker; a decoder that answers
    another size for a file (here every image turned, as a host decoder turns a photo it reads an orientation for)
    gets each box's pixels within the image it gave, as the worker's pixel_box computes them, never an empty crop."""
    blobs = jpegs(96, 4)
    left = crop.CroppedSplit(Encoded(blobs), DEIT, image_size=32, eval_crop=None, device_jpegs=True)
    batch = left.__getitems__(items(3, range(4)))
    # turned and smaller than every header (64 x 96, 96 x 82): a box drawn for the header can start past its edge
    turned = [image_from_bytes(blob, "x").transpose(Image.Transpose.ROTATE_90).crop((0, 0, 24, 40)) for blob in blobs]
    decoded = [torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in turned]  # (3, 40, 24) each
    assert any(left >= 24 or top >= 40 for left, top, *_ in batch.jpegs.pixels)
    monkeypatch.setattr(crop.decode, "decode_packed", lambda blob, rows, device: ([*decoded], 0))
    images, _ = crop.on_device(batch, torch.device("cpu"))
    for row, (image, box, flip) in enumerate(zip(decoded, batch.jpegs.boxes, batch.jpegs.flips, strict=True)):
        left_, top, right, bottom = crop.pixel_box(box, (24, 40))
        expected = crop.square(image[:, top:bottom, left_:right], 32)
        assert torch.equal(images[row], (expected.flip(-1) if flip else expected).permute(1, 2, 0))


def test_a_damaged_jpeg_in_a_batch_is_one_line_naming_it():
    """A JPEG whose header reads but whose data stops half-way fails at the cropped decode: the one decoder reads it
    again and names it (UnreadableImage), not PIL's bare OSError."""
    from mobile_moe.data.image_files import UnreadableImage

    blobs = jpegs(128, 4)
    blobs[2] = blobs[2][: len(blobs[2]) // 2]
    split = crop.CroppedSplit(Encoded(blobs), DEIT, image_size=32, eval_crop=None)
    with pytest.raises(UnreadableImage, match="cannot read image 2"):
        split.__getitems__(items(0, range(4)))


def test_a_fractional_box_on_a_tiny_image_keeps_its_pixels():
    """An eval crop's box is fractional (the centre square of a 1 x 2 image starts at 0.5625): rounded to whole pixels
    it could be empty, which Pillow resizes to black; the crop takes the pixels it covers instead."""
    image = Image.fromarray(np.full((1, 2, 3), 200, np.uint8))
    assert (np.asarray(crop.resized_crop(image, np.array([0.0, 0.5625, 1.0, 0.875]), 8, lazy=False)) == 200).all()


def test_a_crop_to_the_edge_of_a_drafted_image_stays_inside_it():
    """A 201 px JPEG drafted to half scale is 101 px; its scale 101 / 201 is no exact binary fraction, so the whole
    image's box, scaled, ends a hair past 101 and its ceil a pixel past the image, which Pillow fills black: the box
    stops at the image's edge."""
    assert 201 * (101 / 201) > 101
    assert crop.pixel_box(np.array([0.0, 0.0, 201.0, 201.0]), (101, 101), (101 / 201, 101 / 201)) == (0, 0, 101, 101)
    photo = photographs()[1].resize((201, 201))
    buffer = io.BytesIO()
    photo.save(buffer, "JPEG", quality=95)
    lazy = crop.lazy_jpeg(buffer.getvalue())
    cropped = crop.resized_crop(lazy, np.array([0.0, 0.0, 201.0, 201.0]), 64, lazy=True)  # draft: 1/2 (101 px)
    assert lazy.size == (101, 101) and cropped[:, :, -1].float().mean() > 20  # no black last column
