"""THE top-k rule (mobile_moe.models.routers.top_k): largest first, equal scores by the lower index. Eager PyTorch, the
Python bundle runtime and the native runner must agree on it, ties included: a router whose probabilities all tie is
the case where torch.topk (which promises no order among ties) and a stable sort could disagree."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import needs_build, tiny_model

from mobile_moe.export.bundle_routing import pick_experts
from mobile_moe.models.routers import top_k


@pytest.mark.parametrize(
    ("scores", "k", "expected"),
    [
        ([0.25, 0.25, 0.25, 0.25], 2, [0, 1]),
        ([0.1, 0.3, 0.3, 0.3], 2, [1, 2]),
        ([0.3, 0.1, 0.3, 0.3], 3, [0, 2, 3]),
        ([0.1, 0.2, 0.3, 0.4], 2, [3, 2]),
        ([0.5, 0.5], 1, [0]),
    ],
)
def test_ties_go_to_the_lower_index_in_torch_and_numpy(scores, k, expected):
    values, indices = top_k(torch.tensor([scores], dtype=torch.float64), k)
    assert indices[0].tolist() == expected
    assert values[0].tolist() == [scores[i] for i in expected]
    # the bundle runtimes' rule (mobile_moe/export/bundle_routing.py) takes its order from top_k
    assert pick_experts(np.asarray(scores, dtype=np.float32), k=k, renormalize=False)[0] == expected


def test_top_k_along_another_dimension():
    scores = torch.tensor([[1.0, 2.0], [1.0, 2.0], [3.0, 0.0]])  # (T=3, E=2): top-2 tokens per expert
    _, indices = top_k(scores, 2, dim=0)
    assert indices.T.tolist() == [[2, 0], [0, 1]]


def _tied_router_model(top_k_: int):
    """A tiny Mobile V-MoE whose router gives every expert the same probability for every image."""
    model = tiny_model("mobile-vmoe", top_k=top_k_, pool="mean").eval()
    with torch.no_grad():
        model.router.proj.weight.zero_()
        model.router.proj.bias.zero_()
    return model


@pytest.mark.export
@pytest.mark.slow  # an ExecuTorch export and a native build (13 s); ties through ONNX are in the fast set
@pytest.mark.parametrize("k", [1, 2])
def test_eager_python_runtime_and_native_runner_agree_on_ties(k, tmp_path, request):
    from mobile_moe.export.bundle import export_bundle
    from mobile_moe.export.runtime import load_bundle

    model = _tied_router_model(k)
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(images).routing.experts.tolist()
    assert eager == [list(range(k))] * 3
    export_bundle(model, tmp_path / "tied", "executorch")
    runtime = load_bundle(tmp_path / "tied")
    assert [runtime.predict(image.numpy()).experts for image in images] == eager
    if needs_build.args[0]:  # skipif condition: no cmake / compiler here
        pytest.skip(needs_build.kwargs["reason"])
    from mobile_moe.device_bench.native_runner import run_native
    from mobile_moe.device_bench.round_settings import RoundSettings
    from mobile_moe.device_bench.workload import Workload, write_raw

    runner = request.getfixturevalue("runner")
    images_file = write_raw(Workload(images.numpy(), "tied"), tmp_path / "images.f32")
    report = run_native(runner, tmp_path / "tied", images_file, RoundSettings(iterations=1, warmup=0))
    assert [row["experts"] for row in report["images"]] == eager
