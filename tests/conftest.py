"""Shared fixtures: tiny models (so the suite stays fast on 2 cores)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from mobile_moe.models.registry import create_model, list_models

# A tiny config per registered model: 32 px images, 8 px patches -> 16 patches, width 32, 3 blocks.
TINY = {"image_size": 32, "patch_size": 8, "num_classes": 7, "depth": 3, "width": 32, "num_heads": 2}
TINY_MOE = {"num_experts": 4, "top_k": 1, "moe_layers": 2}
# Each model's tiny MoE options: 4 experts; per-token routers pick k = 2 of them (V-MoE's and WideNet's default).
TINY_OPTIONS = {
    "vit": {},
    "mobile-vmoe": TINY_MOE,
    "hard-moe": {"num_experts": 4, "moe_layers": 2, "pca_dims": 8},
    "vmoe": {"num_experts": 4, "top_k": 2, "moe_layers": 2},
    "experts-choice": {"num_experts": 4, "moe_layers": 2},
    "soft-moe": {"num_experts": 4, "moe_layers": 2},
    "widenet": {"num_experts": 4, "top_k": 2},
}


def tiny_model(name: str, **overrides) -> torch.nn.Module:
    fields = dict(TINY, **TINY_OPTIONS[name])
    fields.update(overrides)
    torch.manual_seed(0)
    return create_model(name, **fields)


def spread_clusters(model: torch.nn.Module, images: torch.Tensor, *, empty: int | None = None) -> None:
    """A Hard MoE's router set so that `images` spread over its experts: PCA the first P feature dimensions, each
    centroid the features of one of the first E images (each nearest its own), and expert `empty`'s far from every
    image (none routed to it)."""
    cfg = model.config
    with torch.no_grad():
        features = model.image_features(images[: cfg.num_experts]).float().cpu()  # (E, D)
    projection = (torch.zeros(cfg.width), torch.eye(cfg.pca_dims, cfg.width)) if cfg.pca_dims else (None, None)
    centroids = features[:, : cfg.pca_dims or cfg.width].clone()
    if empty is not None:
        centroids[empty] = 1e3
    model.router.set_clusters(*projection, centroids)


def backward_with_a_gradient_per_element(output: torch.Tensor) -> None:
    """Backpropagate a loss whose gradient differs at every element of `output`: the backward of torch._grouped_mm's
    CPU fallback (torch 2.14) refuses an upstream gradient with stride 0, which `.sum()` hands it."""
    (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum().backward()


def source_model(source: str, **kwargs) -> torch.nn.Module:
    """A timm or torchvision model ("timm:NAME", "torchvision:NAME") with seeded random weights, as `import` reads."""
    import timm
    import torchvision

    library, _, name = source.partition(":")
    torch.manual_seed(0)
    if library == "timm":
        return timm.create_model(name, pretrained=False, **kwargs).eval()
    model = torchvision.models.get_model(name, weights=None, **kwargs).eval()
    torch.nn.init.normal_(model.heads.head.weight, std=0.02)  # torchvision starts it at 0: every logit would be 0
    return model


@pytest.fixture(params=list_models())
def model_name(request) -> str:
    return request.param


@pytest.fixture
def images() -> torch.Tensor:
    return torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def pytest_configure(config):
    """Parallel workers (pytest-xdist) share the cores: each takes its share of torch threads, not all of them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(path)` once per test session, whatever the number of parallel workers: the first to get here builds
    into the session's shared temporary directory while the others wait for it, then all use the result."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: one basetemp per worker
    out, done = shared / name, shared / f"{name}.done"
    with FileLock(shared / f"{name}.lock"):
        if not done.exists():
            build(out)
            done.touch()
    return out


@contextlib.contextmanager
def one_torch_thread():
    """Training in tests runs on one torch thread: on CI's 2 shared cores, two spinning OpenMP threads per process
    slow training several-fold. For module-scoped fixtures; tests use the `one_thread` fixture."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    with one_torch_thread():
        yield


def _missing_build_tools() -> list[str]:
    from mobile_moe.library.build import missing_tools

    return missing_tools()


def write_imagefolder(root: Path, counts: dict[str, int], classes: tuple[str, ...], size: tuple[int, int]) -> Path:
    """ROOT/<split>/<class>/<i>.png of random RGB images (height, width = size): `counts[split]` per class."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in counts.items():
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


# The file kinds an image folder may hold, and which of them a GPU decodes (mobile_moe/data/decode.py)
FILE_KINDS = {"baseline": True, "progressive": False, "cmyk": False, "grayscale": False, "png": False}


def write_image_kind(path: Path, kind: str, pixels) -> Path:
    """`pixels` (h, w, 3) uint8 saved at `path` as one of FILE_KINDS (JPEGs at quality 90)."""
    from PIL import Image

    image = Image.fromarray(pixels)
    if kind == "png":
        image.save(path, format="PNG")
    elif kind == "cmyk":
        image.convert("CMYK").save(path, format="JPEG", quality=90)
    elif kind == "grayscale":
        image.convert("L").save(path, format="JPEG", quality=90)
    else:
        image.save(path, format="JPEG", quality=90, progressive=kind == "progressive")
    return path


needs_build = pytest.mark.skipif(
    bool(_missing_build_tools()), reason=f"cannot build the native runner: {_missing_build_tools()}"
)


@pytest.fixture(scope="session")
def runner() -> Path:
    """The native runner, built once per source version (cached across sessions)."""
    from mobile_moe.library.build import build_runner

    if _missing_build_tools():
        pytest.skip(f"cannot build the native runner: {', '.join(_missing_build_tools())} missing")
    return build_runner()


@pytest.fixture(scope="session")
def internal_checks(runner) -> Path:
    """The library's hashes and file checks as a program (tests/internal_checks.cpp), from the runner's build."""
    from mobile_moe.library.build import build_internal_checks

    return build_internal_checks()


def bundle_model() -> torch.nn.Module:
    """The model of the session's bundles (`bundle`, `onnx_bundle`): a tiny Mobile V-MoE (E=4, k=1). Mean pooling:
    with a class token, an untrained router sends every random image to the same expert; the mean of the patch tokens
    tells them apart."""
    return tiny_model("mobile-vmoe", pool="mean").eval()


def bundle_images(count: int = 24) -> torch.Tensor:
    """Seeded random images; bundle_model sends them to every one of its 4 experts."""
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def session_bundle(tmp_path_factory, backend: str) -> Path:
    """bundle_model exported once per test session to `backend` (an export takes 4-14 s on 2 cores), with its own
    input normalization and sample images, as export's bundle builder writes it. Tests that change it work on a copy."""
    from mobile_moe.export.bundle import export_bundle

    options = {"sample_images": bundle_images(6), "mean": [0.5] * 3, "std": [0.25] * 3}
    export = lambda out: export_bundle(bundle_model(), out, backend, **options)  # noqa: E731
    return built_once(tmp_path_factory, f"tiny-moe-{backend}", export)


@pytest.fixture(scope="session")
def bundle(tmp_path_factory) -> Path:
    """bundle_model as an ExecuTorch bundle."""
    return session_bundle(tmp_path_factory, "executorch")


@pytest.fixture(scope="session")
def onnx_bundle(tmp_path_factory) -> Path:
    """bundle_model as an ONNX bundle."""
    return session_bundle(tmp_path_factory, "onnx")


@pytest.fixture(scope="session", autouse=True)
def image_checks_in_the_sessions_temporary_folder(tmp_path_factory):
    """Image folders' check verdicts (mobile_moe/data/image_check.py) go under the session's temporary folder, not
    the user's ~/.cache: the suite leaves nothing behind, and every session decodes its folders afresh."""
    from mobile_moe.data import image_check

    root = tmp_path_factory.getbasetemp()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(image_check, "cache_root", lambda: root)
        yield


@pytest.fixture(scope="session", autouse=True)
def packed_weights_in_the_sessions_temporary_folder(tmp_path_factory):
    """The native runner's packed-weight cache (on by default) goes under the session's temporary folder, for this
    process and every command it starts: the suite leaves nothing in the user's cache, and starts from an empty one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOBILE_MOE_WEIGHT_CACHE", str(tmp_path_factory.getbasetemp() / "packed-weights"))
        yield
