"""Which experts a bundle's image takes: mobile_moe/export/bundle_routing.py owns the rules, and libmobile_moe's
bundle_routing.cpp is their C++ translation. The rules' own cases, then thousands of random ones built to tie and to
sit on the margin's edge, go through both here and must agree bit for bit (experts, gates, refusals)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from mobile_moe.export.bundle_routing import pick_experts, used_experts
from mobile_moe.library.build import SOURCE_DIR, host_compiler
from mobile_moe.models.routers import top_k

DRIVER = Path(__file__).with_name("bundle_routing_driver.cpp")

CASES = [  # probs, k, resident, margin, expected experts
    ([0.1, 0.5, 0.4], 1, {2}, 0.0, [1]),  # margin 0: plain top-k, resident or not
    ([0.1, 0.5, 0.4], 1, {2}, 0.1, [2]),  # within the margin (0.4 >= 0.5 - 0.1): the resident one
    ([0.1, 0.5, 0.4], 1, {2}, 0.05, [1]),  # outside it
    ([0.1, 0.5, 0.4], 1, {1}, 0.5, [1]),  # the top expert is resident: nothing to avoid
    ([0.3, 0.3, 0.4], 1, {0, 1}, 0.2, [0]),  # two resident candidates tie: the lower index
    ([0.4, 0.3, 0.2, 0.1], 2, {3}, 0.15, [0, 1]),  # k = 2: the resident 0.1 is too far from either slot
    ([0.4, 0.3, 0.2, 0.1], 2, {2}, 0.15, [0, 2]),  # k = 2: 0.2 >= 0.3 - 0.15 takes the second slot
    ([0.4, 0.3, 0.2, 0.1], 2, {2}, 0.25, [2, 1]),  # the first slot (0.4) takes it first; 1 is not resident
    ([0.25, 0.25, 0.25, 0.25], 1, {3}, 0.0, [0]),  # ties, margin 0: the lower index
    ([0.25, 0.25, 0.25, 0.25], 3, set(), 0.0, [0, 1, 2]),
    ([0.5, 0.5], 1, {1}, 1e-46, [0]),  # below float32's range: 0 to the runner's --cache-margin, and so here
]


@pytest.mark.parametrize("probs, k, resident, margin, expected", CASES)
def test_pick_experts(probs, k, resident, margin, expected):
    experts, gates = pick_experts(np.float32(probs), k=k, renormalize=False, resident=resident, margin=margin)
    assert experts == expected and gates == [float(np.float32(probs[e])) for e in expected]


def test_margin_zero_is_the_models_top_k_and_renormalised_gates_sum_to_one():
    probs = np.random.default_rng(0).dirichlet(np.ones(10), size=200).astype(np.float32)
    for row in probs:
        experts, gates = pick_experts(row, k=2, renormalize=True, resident={0, 5})
        values, indices = top_k(torch.from_numpy(row), 2)
        assert experts == indices.tolist()
        assert gates == (values / values.sum()).tolist()  # float32 division, as the model renormalises


def test_used_experts_are_those_with_token_slots_ascending_with_their_share():
    slots = np.float32([[[0, 3, 1, 0], [2, 2, 0, 0]]])  # (1, G=2, E=4)
    assert used_experts(slots) == ([0, 1, 2], [0.25, 0.625, 0.125])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: pick_experts(np.float32([0.5, np.nan]), k=1, renormalize=False), "non-finite probability"),
        (lambda: pick_experts(np.float32([0.5, 0.5]), k=3, renormalize=False), "top_k 3 with 2 experts"),
        (lambda: used_experts(np.float32([[[1, -1], [1, 2]]])), "negative or non-finite expert token count"),
        (lambda: used_experts(np.float32([[[1, np.inf]]])), "negative or non-finite expert token count"),
    ],
)
def test_what_only_a_corrupt_graph_gives_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _hex(values) -> str:
    return " ".join(float(v).hex() for v in np.asarray(values, dtype=np.float32).reshape(-1))


def _pick_line(probs: np.ndarray, k: int, renormalize: bool, resident: set[int], margin: np.float32) -> str:
    experts = " ".join(map(str, sorted(resident)))
    return f"pick {k} {int(renormalize)} {_hex([margin])} {probs.size} {_hex(probs)} {len(resident)} {experts}"


def _random_pick(rng: np.random.Generator) -> tuple[tuple, str]:
    """Probabilities on a coarse grid (ties) or not; a margin of 0, at random, or exactly a gap between two of them
    (the edge of `>=`); sometimes a NaN or a k out of range (refusals)."""
    num_experts = int(rng.integers(1, 12))
    probs = rng.dirichlet(np.ones(num_experts)).astype(np.float32)
    if rng.random() < 0.5:
        probs = (np.round(probs * 8) / 8).astype(np.float32)
    if rng.random() < 0.02:
        probs[rng.integers(num_experts)] = np.nan
    k = int(rng.integers(1, min(num_experts, 3) + 1)) if rng.random() > 0.02 else num_experts + 1
    resident = {int(e) for e in np.flatnonzero(rng.random(num_experts) < 0.4)}
    a, b = rng.integers(num_experts, size=2)
    margin = rng.choice([np.float32(0), np.float32(rng.uniform(0, 0.5)), abs(probs[a] - probs[b])])
    renormalize = bool(rng.random() < 0.5)
    return (probs, k, renormalize, resident, np.float32(margin)), _pick_line(probs, k, renormalize, resident, margin)


def _random_used(rng: np.random.Generator) -> tuple[np.ndarray, str]:
    sets, num_experts = int(rng.integers(1, 4)), int(rng.integers(1, 9))
    slots = rng.integers(0, 4, size=(1, sets, num_experts)).astype(np.float32)
    if rng.random() < 0.05:
        slots[0, 0, 0] = rng.choice([-1.0, np.inf, np.nan])
    return slots, f"used {num_experts} {slots.size} {_hex(slots)}"


def _as_python_hex(answer: str) -> str:
    """The driver's line with its %a floats rewritten as Python writes them (0x1.8p-1 both ways, compared exactly)."""
    words = answer.split()
    if words[0] != "ok":
        return answer
    count = int(words[1])
    return " ".join([*words[: 2 + count], *(float.fromhex(word).hex() for word in words[2 + count :])])


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    compiler = host_compiler()  # the one the runner itself is built with
    if not compiler:
        pytest.skip("no C++ compiler to build bundle_routing.cpp with")
    binary = tmp_path_factory.mktemp("bundle_routing") / "driver"
    sources = [str(DRIVER), str(SOURCE_DIR / "src" / "bundle_routing.cpp")]
    command = [compiler, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{SOURCE_DIR / 'src'}", *sources]
    built = subprocess.run([*command, "-o", str(binary)], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.fail(f"bundle_routing.cpp does not build alone:\n{built.stderr}")
    return binary


def _pick(probs, k, renormalize, resident, margin) -> str:
    return _owner(lambda: pick_experts(probs, k=k, renormalize=renormalize, resident=resident, margin=margin))


def _owner(rule) -> str:
    """The Python rule's answer in the driver's words."""
    try:
        experts, gates = rule()
    except ValueError:
        return "error"
    return " ".join(["ok", str(len(experts)), *map(str, experts), *(float(g).hex() for g in gates)])


def test_the_native_translation_answers_as_the_owner_does(driver):
    rng = np.random.default_rng(0)
    table = [(np.float32(probs), k, False, resident, np.float32(margin)) for probs, k, resident, margin, _ in CASES]
    picks = [(args, _pick_line(*args)) for args in table] + [_random_pick(rng) for _ in range(3000)]
    used = [_random_used(rng) for _ in range(500)]
    expected = [_pick(*args) for args, _ in picks] + [_owner(lambda s=slots: used_experts(s)) for slots, _ in used]
    lines = [line for _, line in picks + used]
    answers = subprocess.run([driver], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    native = [_as_python_hex(answer) for answer in answers.stdout.splitlines()]
    assert len(native) == len(lines) and "bad" not in native  # every line read as written
    disagreements = [(line, want, got) for line, want, got in zip(lines, expected, native, strict=True) if want != got]
    assert not disagreements, disagreements[:3]
    # The cases reached every branch: refusals, and choices the margin changed.
    assert {answer.split()[0] for answer in expected} == {"ok", "error"}
    assert any(_pick(*args) != _pick(*args[:4], np.float32(0)) for args, _ in picks)
