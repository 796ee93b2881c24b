"""The training loop reads the device on the host once per log interval, as nanoGPT and torchvision's references do.

Every way a tensor reaches the host (item, tolist, bool, float, int, cpu, numpy) is counted by where it was called.
Syncs inside the model are its own: a per-image MoE's grouped dispatch reads its group sizes (mobile_moe/models/moe.py),
once per forward."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from torch.utils.data import DataLoader, TensorDataset

from mobile_moe.data.inputs import WorkerBatches
from mobile_moe.training import engine, recipes
from mobile_moe.training.distributed import Placement
from mobile_moe.training.routing import TrainingForward

pytestmark = pytest.mark.usefixtures("one_thread")

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
OURS = Path(engine.__file__).resolve().parents[2]  # the checkout
PACKAGES = ("mobile_moe",)  # where the model and the training loop live (not the tests, not .venv)


@pytest.fixture
def host_reads(monkeypatch) -> Counter:
    """(file, function) -> host reads made from our code (not torch's, not the DataLoader's)."""
    seen: Counter = Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            caller = sys._getframe(1)
            path = Path(caller.f_code.co_filename).resolve()
            if path.is_relative_to(OURS) and path.relative_to(OURS).parts[0] in PACKAGES:
                seen[(path.relative_to(OURS).as_posix(), caller.f_code.co_name)] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


def epoch_of(name: str, steps: int, log_every: int) -> tuple[engine.Optimisation, DataLoader, engine.EpochContext]:
    model = tiny_model(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    opt = engine.Optimisation(TrainingForward(model), model, optimizer, schedule)
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(4 * steps, 3, 32, 32, generator=generator), torch.arange(4 * steps) % 7
    loader = DataLoader(TensorDataset(images, labels), batch_size=4)
    cfg = recipes.tiny().replace(epochs=1)
    batches = WorkerBatches(7, torch.device("cpu"), None)
    ctx = engine.EpochContext(cfg, Placement(0, 1, torch.device("cpu")), batches, None, False, log_every)
    return opt, loader, ctx


@pytest.mark.parametrize("name", ["vit", "mobile-vmoe", "hard-moe", "vmoe"])
def test_one_host_read_per_log_interval(name, host_reads):
    opt, loader, ctx = epoch_of(name, steps=23, log_every=10)
    row = engine.train_one_epoch(opt, loader, ctx, epoch=0)
    model_reads = {key: n for key, n in host_reads.items() if key[0] == "mobile_moe/models/moe.py"}
    loop_reads = {key: n for key, n in host_reads.items() if key not in model_reads}
    assert loop_reads == {("mobile_moe/training/engine.py", "read"): 3}  # after steps 10, 20 and 23
    if name in ("mobile-vmoe", "hard-moe"):  # one grouping per step, shared by every MoE block (and Hard MoE's heads)
        assert model_reads == {("mobile_moe/models/moe.py", "expert_groups"): 23}
    else:
        assert model_reads == {}
    assert math.isfinite(row["train_loss"]) and 0 <= row["train_top1"] <= 1


def test_a_non_finite_loss_is_reported_at_its_step(monkeypatch):
    opt, loader, ctx = epoch_of("vit", steps=23, log_every=10)
    real = engine.losses.training_loss
    calls = []

    def nan_at_step_13(*args, **kwargs):
        terms = real(*args, **kwargs)
        calls.append(None)
        return terms._replace(total=terms.total * float("nan")) if len(calls) == 13 else terms

    monkeypatch.setattr(engine.losses, "training_loss", nan_at_step_13)
    with pytest.raises(engine.NonFiniteLoss, match=r"at epoch 1, step 13 \(global step 13\)"):
        engine.train_one_epoch(opt, loader, ctx, epoch=0)
    assert len(calls) == 20  # caught at the read after step 20


def test_slow_steps_are_read_every_few_seconds_not_only_every_log_interval(host_reads):
    """An epoch of few slow steps (6 of a photo folder's) still shows progress within it: a read is also due once
    ctx.progress_seconds have passed (0 here: every step)."""
    opt, loader, ctx = epoch_of("vit", steps=6, log_every=10)
    ctx.progress_seconds = 0.0
    engine.train_one_epoch(opt, loader, ctx, epoch=0)
    assert host_reads[("mobile_moe/training/engine.py", "read")] == 6


def test_the_time_left_follows_the_recent_epochs_pace():
    from mobile_moe.training.estimate import time_left

    assert time_left([60.0], 10) == "  about 10 min left"
    assert time_left([600.0, 30.0, 30.0, 30.0], 4) == "  about 2 min left"  # the slow first epoch is forgotten
    assert time_left([30.0, 30.0], 0) == ""
    assert time_left([4.5], 11) == "  about 50 s left"  # not "1 min": a short run's estimate in seconds


def test_an_interrupted_train_says_the_command_that_continues_it(monkeypatch, capsys):
    from mobile_moe.app.cli import main
    from mobile_moe.training import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    argv = ["train", "--model", "vit", "--data", "imagefolder:my photos", "--out", "runs/a"]
    monkeypatch.setattr("sys.argv", ["mobile-moe", *argv])
    assert main(argv) == 130
    assert "continue with: mobile-moe train --model vit --data 'imagefolder:my photos' --out runs/a --resume\n" in (
        capsys.readouterr().err)  # fmt: skip


def test_input_wait_is_the_steady_state_not_the_workers_start():
    """A loader whose first batch takes 1 s (workers starting, the queue's first fill) and whose others are ready at
    once: the epoch waited about half its time, but input_wait, after the first step, is near 0, and its images/s
    after the first step is the steps' own rate. A loader that is slow on every batch still reads as waiting, at its
    own rate."""
    import time

    opt, loader, ctx = epoch_of("vit", steps=6, log_every=10)

    def delayed(first: float, rest: float):
        for step, batch in enumerate(loader):
            time.sleep(first if step == 0 else rest)
            yield batch

    class Loader:
        def __init__(self, first: float, rest: float):
            self.first, self.rest = first, rest

        def __len__(self) -> int:
            return len(loader)

        def __iter__(self):
            return delayed(self.first, self.rest)

    starting = engine.train_one_epoch(opt, Loader(1.0, 0.0), ctx, epoch=0)
    assert starting["input_wait"] < 0.2 and starting["epoch_time_s"] > 1.0
    assert starting["steady_images_per_s"] > 3 * starting["images_per_s"]  # the 1 s start is not the steps' rate
    slow = engine.train_one_epoch(opt, Loader(0.0, 0.3), ctx, epoch=0)
    assert slow["input_wait"] > 0.5
    assert slow["steady_images_per_s"] < 1.5 * slow["images_per_s"]


def test_steady_images_per_s_leaves_out_the_workers_first_round():
    """Three workers start together, so a slow loader's first three batches come at once (after 0.5 s), and the others
    0.2 s apart: after the first step the epoch would read 5 batches in 0.6 s, faster than the loader ever is; the
    window after the first round reads the loader's own pace, 4 images (a batch) in no less than 0.2 s."""
    import time

    opt, loader, ctx = epoch_of("vit", steps=6, log_every=10)

    class ThreeWorkers:
        num_workers = 3

        def __len__(self) -> int:
            return len(loader)

        def __iter__(self):
            for step, batch in enumerate(loader):
                time.sleep(0.5 if step == 0 else 0.0 if step < 3 else 0.2)
                yield batch

    row = engine.train_one_epoch(opt, ThreeWorkers(), ctx, epoch=0)
    assert 0.8 * 4 / 0.2 < row["steady_images_per_s"] <= 4 / 0.2


def test_an_epochs_device_refusals_reach_its_row_and_its_line():
    """The files the device's decoder refused in an epoch (the batch preparer's running count, read before and after
    the epoch) are the row's device_refused, and the epoch line says how many; none say nothing."""
    from mobile_moe.training.train import epoch_line

    opt, loader, ctx = epoch_of("vit", steps=3, log_every=10)

    class Refusing(WorkerBatches):  # the per-image batches, with a refusal counted in each batch as a decoder would
        def batch(self, loader_batch, key):
            self.refused_files += 1
            return super().batch(loader_batch, key)

    ctx.inputs = Refusing(7, torch.device("cpu"), None, refused_files=5)  # 5 from an earlier epoch
    row = engine.train_one_epoch(opt, loader, ctx, epoch=0)
    assert row["device_refused"] == 3
    fields = {"epoch": 1, "val_top1": 0.5, "val_top5": 0.9, "lr": 1e-3}
    assert ", 3 files decoded on the host (the device's decoder refused them)" in epoch_line({**row, **fields})
    assert "decoded on the host" not in epoch_line({**row, **fields, "device_refused": 0})


def test_the_epochs_parts_add_up_to_its_steady_window_and_name_what_was_slow(monkeypatch):
    """epoch_parts (training/attribution.py): the main thread's parts, and the rest (`other_s`), add up to the window
    after the loader's first round, and the parts cover it (the rest under 5%). A loader slow on every batch shows as
    waiting; a step made slow on the CPU as the step's CPU time; a step that sleeps (as one blocked on the
    interpreter lock or the device does) as the step's time off the CPU; a slow progress read as the loop's own."""
    import time

    from mobile_moe.training.attribution import MAIN_PARTS

    opt, loader, ctx = epoch_of("vit", steps=8, log_every=1)

    class Slow:
        def __len__(self) -> int:
            return len(loader)

        def __iter__(self):
            for batch in loader:
                time.sleep(0.05)
                yield batch

    def parts_of(row: dict) -> str:
        """The epoch's largest part of the main thread's (a busy machine moves the others), its parts checked."""
        parts = row["epoch_parts"]
        main = sum(parts[name] for name in MAIN_PARTS)
        assert abs(main + parts["other_s"] - parts["window_s"]) < 1e-5
        assert parts["other_s"] < 0.05 * parts["window_s"], parts  # the parts cover the window
        assert parts["gpu_busy_s"] is None and parts["ahead_busy_s"] is None  # the CPU: no events, no thread
        return max(MAIN_PARTS, key=parts.get)

    assert parts_of(engine.train_one_epoch(opt, Slow(), ctx, epoch=0)) == "waiting_s"

    real_update = engine.update

    def spinning(*args, **kwargs):  # 50 ms on the CPU: a heavy step
        until = time.thread_time() + 0.05
        while time.thread_time() < until:
            pass
        return real_update(*args, **kwargs)

    monkeypatch.setattr(engine, "update", spinning)
    assert parts_of(engine.train_one_epoch(opt, loader, ctx, epoch=0)) == "step_cpu_s"
    monkeypatch.setattr(engine, "update", lambda *args, **kwargs: time.sleep(0.05) or real_update(*args, **kwargs))
    assert parts_of(engine.train_one_epoch(opt, loader, ctx, epoch=0)) == "step_blocked_s"
    monkeypatch.setattr(engine, "update", real_update)
    real_read = engine.EpochSums.read
    monkeypatch.setattr(engine.EpochSums, "read", lambda self: time.sleep(0.05) or real_read(self))
    assert parts_of(engine.train_one_epoch(opt, loader, ctx, epoch=0)) == "loop_s"
