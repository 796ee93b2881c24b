"""What only a CUDA device can check (`make gpu-check` runs these first; `make test` deselects them)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_compile import compiled_against_eager, loss_of
from test_grouped_gemm_training import (
    BF16,
    TRAINED_SHAPES,
    assert_hard_moe_runs_its_stacked_experts_as_grouped_gemms_equal_to_its_loop_in_bf16,
    assert_the_compiled_bf16_step_runs_the_grouped_gemm_in_one_graph,
)
from test_models import ROUTED, assert_routes_in_fp32_under_bf16_autocast

from mobile_moe.app.cli import main
from mobile_moe.models.moe import ExpertMLPs, compile_model, expert_groups, grouped_gemm_device, grouped_gemm_fits
from mobile_moe.training.evaluate import autocast
from mobile_moe.training.run_dir import load_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("name", ["vit", "mobile-vmoe", "vmoe", "hard-moe"])
def test_inductor_compiled_cuda_training_is_one_graph_equal_to_eager(name):
    """Inductor's kernels round differently (fused reductions, TF32 convolutions on cuDNN): the compiled logits and
    gradients must be as close to eager's as fp32 arithmetic itself puts eager from the float64 answer."""
    quiet = {"noise_std": 0.0} if name == "vmoe" else {}  # float64 draws other noise than float32 from one seed
    compiled_against_eager(name, CUDA, "inductor", tolerance=None, **quiet)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "max-autotune"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_the_grouped_gemm_equals_the_expert_loop_forward_and_backward_in_bf16(top_k, compiled):
    """torch._grouped_mm on the stacked experts (the CUDA dispatch), eager and as inductor's max-autotune lowers it (its
    grouped-GEMM templates, forward and backward), against the per-expert loop, under bf16 autocast: outputs and every
    gradient within bf16's rounding, an expert left without items included. (The experts alone: max-autotune over a
    whole model's GEMMs took over 300 s on an H200.)"""
    if not grouped_gemm_device(torch.cuda.current_device()):
        pytest.skip("the grouped GEMM runs on sm90 only (moe.grouped_gemm_device)")
    torch.manual_seed(0)
    experts = ExpertMLPs(4, 64, 256).to(CUDA)
    x = torch.randn(32, 17, 64, device=CUDA, requires_grad=True)
    chosen = torch.randint(0, 3, (32, top_k), device=CUDA)  # expert 3 gets nothing
    gates = torch.rand(32, top_k, device=CUDA, requires_grad=True)

    def mixture(x, gates, read_sizes):
        assert grouped_gemm_fits(x, 64, 256, on_grouped_gemm_device=experts.on_grouped_gemm_device)
        return experts.mixture(x, expert_groups(chosen, gates, 4, read_sizes=read_sizes))

    torch._dynamo.reset()
    # fullgraph: a break (or a fallback to eager) fails the compile instead of quietly testing eager again
    grouped = compile_model(mixture, mode="max-autotune-no-cudagraphs", fullgraph=True) if compiled else mixture
    results = []
    for run, read_sizes in ((grouped, False), (mixture, True)):  # the grouped GEMM, then the per-expert loop
        with autocast(CUDA):
            y = run(x, gates, read_sizes)
        y.float().square().mean().backward()
        grads = [x.grad, gates.grad, *(p.grad for p in experts.parameters())]
        results.append((y.float(), [g.clone() for g in grads]))
        x.grad = gates.grad = None
        experts.zero_grad()
    (gemm, gemm_grads), (loop, loop_grads) = results
    bf16 = 2 * BF16  # two roundings of bf16's unit in each product's inputs
    torch.testing.assert_close(gemm, loop, rtol=bf16, atol=bf16 * loop.abs().max().item())
    for got, want in zip(gemm_grads, loop_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=bf16, atol=bf16 * want.abs().max().item())


@pytest.mark.parametrize("shape", TRAINED_SHAPES)
def test_the_compiled_bf16_training_step_runs_the_grouped_gemm_in_one_graph_and_leaves_an_empty_expert_alone(
    shape, monkeypatch
):
    """Training as it runs on an H100/H200, at the toy shapes and DeiT-Ti/16's (the CPU checks the toy's on the
    fallback: tests/test_grouped_gemm_training.py)."""
    assert_the_compiled_bf16_step_runs_the_grouped_gemm_in_one_graph(shape, CUDA, monkeypatch)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_hard_moe_runs_its_stacked_experts_as_grouped_gemms_equal_to_its_loop_in_bf16(compiled, monkeypatch):
    assert_hard_moe_runs_its_stacked_experts_as_grouped_gemms_equal_to_its_loop_in_bf16(
        compiled=compiled, device=CUDA, monkeypatch=monkeypatch
    )


@pytest.mark.parametrize("name", ROUTED)
def test_a_router_decides_in_fp32_under_cuda_bf16_autocast(name):
    """cuBLAS under bf16 autocast: every routing decision (and the router's logits, bit for bit) is the fp32 model's."""
    assert_routes_in_fp32_under_bf16_autocast(name, CUDA)


@pytest.mark.parametrize("name", ["vit", "mobile-vmoe"])
def test_a_bf16_autocast_step_is_finite_and_keeps_float32_weights(name):
    model = tiny_model(name).to(CUDA).train()
    with autocast(CUDA):
        output = model(torch.randn(8, 3, 32, 32, device=CUDA))
    assert output.logits.dtype == torch.bfloat16
    loss_of(output).float().backward()
    assert all(
        p.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None
    )


def test_a_run_trained_on_cuda_resumes_and_evaluates_on_a_cpu(tmp_path):
    """Checkpoints hold CPU tensors whatever trained them (map_location on load), and the run goes on on a CPU."""
    argv = ["train", "--model", "mobile-vmoe", "--size", "3x64", "--patch", "8", "--image-size", "32",
            "--experts", "3", "--data", "synthetic:classes=6,super=3,per_class=30", "--super-classes", "truth",
            "--recipe", "tiny", "--batch-size", "16", "--quiet", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main([*argv, "--epochs", "1", "--device", "cuda"]) == 0
    assert main([*argv, "--epochs", "2", "--device", "cpu", "--resume"]) == 0
    run = load_run(tmp_path / "run", "last")
    assert run.checkpoint["epoch"] == 2
    assert all(value.device.type == "cpu" for value in run.model.state_dict().values())


def test_batches_prepared_ahead_on_a_side_stream_are_the_ones_prepared_in_turn():
    """The thread's stream hands each batch over with an event: the step's stream reads it complete, never early."""
    from mobile_moe.data.ahead import BatchesAhead

    def prepare(step, size):
        generator = torch.Generator(CUDA).manual_seed(step)
        x = torch.randn(size, size, device=CUDA, generator=generator)
        return (x @ x @ x).tanh(), None  # long enough on the side stream that a missing wait would read it early

    results = []
    for in_thread in (False, True):
        with BatchesAhead([2048] * 6, prepare, CUDA, in_thread=in_thread) as batches:
            results.append([images.sum().item() for images, _ in batches])
    assert results[0] == results[1]


def test_the_crop_pipelines_compiled_cuda_graph_answers_as_the_cpus_in_place_path():
    """--input-pipeline crop on CUDA (BatchGraph, fixed shape, compiled: inductor's kernels) against the CPU's in-place
    path (each op on the images that drew it, eager) on the same batches and draws: the same targets, and images
    equal but where inductor's fused arithmetic puts a value a level apart (at most 5% of the values; more than a
    level, where a later op such as Equalize moved that difference, on at most 0.5%)."""
    import numpy as np

    from mobile_moe.data import batch_augment, batch_graph
    from mobile_moe.training import recipes

    size, count = 64, 32
    kwargs = {"mean": (0.5, 0.4, 0.3), "std": (0.2, 0.25, 0.3), "num_classes": 10}
    on_cpu = batch_graph.BatchGraph(**kwargs, fixed_shape=False)
    on_cuda = torch.compile(batch_graph.BatchGraph(**kwargs).to(CUDA), fullgraph=True, dynamic=False)
    generator = torch.Generator().manual_seed(0)
    for step in range(4):
        draws = batch_augment.draw(recipes.deit().augmentation, np.full((count, 2), 200), image_size=size,
                                   key=batch_augment.StepKey(0, 0, 0, step), eval_crop=None)  # fmt: skip
        params = batch_graph.params(draws, size)
        images = torch.randint(0, 256, (count, size, size, 3), dtype=torch.uint8, generator=generator)
        args = (images, torch.arange(count) % 10, params.theta, params.colour, params.factor, params.erase, params.mix)
        expected_images, expected_targets = on_cpu(*args)
        got_images, got_targets = on_cuda(*(arg.to(CUDA) for arg in args))
        level = 1 / (255 * 0.2)  # one uint8 level after normalising, at the smallest std
        difference = (got_images.cpu() - expected_images).abs()
        assert (difference > 1e-5).float().mean() < 0.05  # a level apart: a value at a level's edge
        assert (difference > level + 1e-5).float().mean() < 0.005  # more: one a later op (Equalize, Posterize) moved
        torch.testing.assert_close(got_targets.cpu(), expected_targets, rtol=0, atol=1e-6)


def test_a_folders_jpegs_decoded_and_cropped_on_cuda_answer_as_the_workers_crop():
    """--input-pipeline crop from an image folder on CUDA: the baseline JPEGs left to the device (nvJPEG, then the
    crop and torchvision's float antialiased resize there) against the worker's crop of the same batch (libjpeg-turbo,
    torch's uint8 resize): equal to a level or two (two IDCTs, two resize roundings), nothing refused. The photos are
    120 px, under the side the worker leaves to the device (decode.source_side_limit: 227 px here) and under 2 S
    (128 px), from which the worker would decode a crop at reduced scale; stored 4:4:4, since nvJPEG's chroma
    upsampling is not libjpeg-turbo's fancy upsampling, which would move colour edges by more than the crop's own
    rounding."""
    from data.test_crop_pipeline import DEIT, Encoded, items, jpegs

    from mobile_moe.data import crop

    blobs = jpegs(120, 12, subsampling=0)
    in_worker = crop.CroppedSplit(Encoded(blobs), DEIT, image_size=64, eval_crop=None).__getitems__(items(1, range(12)))
    left = crop.CroppedSplit(Encoded(blobs), DEIT, image_size=64, eval_crop=None, device_jpegs=True)
    batch = left.__getitems__(items(1, range(12)))
    assert batch.jpegs is not None and len(batch.jpegs.rows) == 12  # every one decoded and cropped on the device
    images, refused = crop.on_device(batch, CUDA)
    difference = (images.cpu().int() - in_worker.images.int()).abs()
    assert refused == 0 and difference.max() <= 3 and difference.float().mean() < 0.5


def test_a_batchs_crops_resized_on_cuda_are_torchvisions_resize_of_each():
    """crop.squares on CUDA, the folder's device crops resized together (batched_squares: the antialiased filter's
    taps gathered for the whole batch), against torchvision's resize_image of each crop on CUDA (its float kernel,
    rounded): within a level (the same filter, summed in another order), for crops smaller, larger and as large as S;
    the same on the CPU as the device is tests/data/test_crop_batched.py."""
    from mobile_moe.data import crop

    generator = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), generator=generator, dtype=torch.uint8).to(CUDA)
              for h, w in [(40, 60), (300, 200), (64, 64), (97, 131)]]  # fmt: skip
    pixels = [(5, 3, 45, 40), (0, 0, 200, 300), (0, 0, 64, 64), (10, 20, 131, 50)]  # left, top, right, bottom
    expected = torch.stack([crop.square(image[:, top:bottom, left:right], 64)
                            for image, (left, top, right, bottom) in zip(images, pixels, strict=True)])  # fmt: skip
    off = (crop.squares(images, pixels, 64).int() - expected.int()).abs()
    assert off.max() <= 1 and (off > 0).float().mean() < 1e-3


def test_nvjpeg_never_writes_into_a_block_whose_freeing_streams_kernels_still_read_it():
    """torchvision's CUDA decoder writes its images from a private stream that does not wait for the current one; on
    the current stream's blocks, a block freed there while a queued kernel still reads it would be the next decode's
    image (the allocator reuses such a block for that stream at once): decode.decode_jpegs allocates on its own
    stream. Here a read of a freed image-sized block waits behind a long kernel while the decode runs."""
    import io

    from PIL import Image

    from mobile_moe.data import decode

    buffer = io.BytesIO()
    Image.new("RGB", (96, 64), (200, 10, 90)).save(buffer, "JPEG", quality=90)
    held = torch.full((3, 64, 96), 7, dtype=torch.uint8, device=CUDA)
    address = held.data_ptr()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of the current stream, then the read below
    total = held.sum(dtype=torch.int64)
    del held  # freed on the current stream, its read still queued
    encoded = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    (image,), refused = decode.decode_jpegs([encoded], ["plain.jpg"], CUDA)
    assert refused == 0 and image.data_ptr() != address
    assert total.item() == 7 * 3 * 64 * 96


def test_train_compile_replays_the_step_as_cuda_graphs_and_trains_as_the_plain_compiled_step(tmp_path):
    """`train --compile` on CUDA records the step's forward and backward as CUDA graphs (inductor's cudagraph trees)
    and replays them; after two epochs its weights are the plain compiled step's (--no-cuda-graphs) within bf16's
    rounding; inductor skipped no graph (a host read or a CPU tensor in the step would have it fall back, silently)."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import get_container

    counters.clear()

    argv = ["train", "--model", "mobile-vmoe", "--size", "3x64", "--patch", "8", "--image-size", "32",
            "--experts", "3", "--data", "synthetic:classes=6,super=3,per_class=40", "--super-classes", "truth",
            "--recipe", "tiny", "--batch-size", "16", "--epochs", "2", "--quiet", "--compile",
            "--device", "cuda"]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "graphed")]) == 0
    assert get_container(torch.cuda.current_device()).tree is not None, "no CUDA graph was recorded"
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert main([*argv, "--no-cuda-graphs", "--out", str(tmp_path / "plain")]) == 0
    graphed, plain = (load_run(tmp_path / name, "last").model.state_dict() for name in ("graphed", "plain"))
    for key, value in plain.items():
        torch.testing.assert_close(graphed[key], value, atol=2e-2, rtol=2e-2, msg=key)
