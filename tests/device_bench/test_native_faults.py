"""Fault injection against the native runner: every bad manifest and every tampered graph is refused with one line.

The runner is driven directly (a bundle can be run by hand on a phone, where no Python checked it): each manifest
mutation of tests/faults.py must exit 2; a flipped byte in a graph must exit 2 (the sha256 no longer matches), and
with the manifest re-sealed (checksums rewritten) the runner must still never die of a signal: it refuses the
program (exit 2: ExecuTorch's program verification, the method signature check) or fails cleanly (exit 1), or, when
the flip only changed weights, runs and prints its JSON. Both tables also run against an AddressSanitizer build (in
the slow set: its build alone takes half a minute), so an out-of-bounds read in the runner fails the test even when it
happens not to crash.

Then the Python side (device_bench.native_runner): sha256 checked before the runner starts, a bad --runner refused
before anything runs, a crash or undecodable output turned into one UsageError line.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import needs_build
from faults import (
    HEADER_BYTES,
    MANIFEST_MUTATIONS,
    WHOLE_MANIFEST_MUTATIONS,
    copy_bundle,
    first_mean_written_as,
    flip_byte,
    flip_offsets,
    mutate_manifest,
    reseal,
    whole_bundle,
    without_each_entry,
    write_manifest_text,
)

from mobile_moe.device_bench.native_runner import run_native
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.errors import UsageError

pytestmark = [pytest.mark.export, needs_build]

# flip_offsets(size, count=12, seed=0) on each file: the header offsets that crashed the runner before, then 12 seeded
# random ones. The graphs' sizes are known only once the session's bundle is exported, so tests take an index.
FLIP_FILES = ("router.pte", "expert.pte", "expert_0.ptd")  # the experts' shared program, expert 0's weights
FLIP_COUNT = 12
HEADER_OFFSETS = {0, 48, 52, 60}  # flatbuffer root and header fields: program verification must refuse these
FLIPS = [
    (name, index, resealed) for name in FLIP_FILES for index in range(4 + FLIP_COUNT) for resealed in (False, True)
]

# Extra JSON-level faults for the runner's own reader (\u escapes, number grammar, control characters).
RAW_MANIFESTS = {
    "bad_unicode_escape": lambda doc: doc.replace('"0"', '"\\u12G4"', 1),
    "short_unicode_escape": lambda doc: doc.replace('"0"', '"\\u12"', 1),
    "lone_surrogate": lambda doc: doc.replace('"0"', '"\\udc00"', 1),
    "control_character": lambda doc: doc.replace('"0"', '"a\tb"', 1),
    "leading_zero": lambda doc: doc.replace('"top_k": 1, "routing"', '"top_k": 01, "routing"', 1),
    "plus_sign": lambda doc: doc.replace('"top_k": 1, "routing"', '"top_k": +1, "routing"', 1),
    "hex_number": lambda doc: doc.replace('"top_k": 1, "routing"', '"top_k": 0x1, "routing"', 1),
    "infinite_mean": first_mean_written_as("1e400"),
    "integer_written_as_float": lambda doc: doc.replace('"top_k": 1, "routing"', '"top_k": 1.0, "routing"', 1),
    "integer_with_exponent": lambda doc: doc.replace('"top_k": 1, "routing"', '"top_k": 1e0, "routing"', 1),
}

TIMEOUT_S = 60  # a hang fails the test; a normal refusal takes milliseconds


@pytest.fixture(scope="session", params=["plain", pytest.param("asan", marks=pytest.mark.slow)])  # asan: a build
def fault_runner(request, runner) -> tuple[Path, dict[str, str]]:
    """The runner and the environment to run it in: the normal build, and an AddressSanitizer build."""
    if request.param == "plain":
        return runner, dict(os.environ)
    from mobile_moe.library.build import SanitizerUnavailable, build_runner, sanitizer_env

    try:
        asan = build_runner(sanitize="address")
    except SanitizerUnavailable as error:  # no libasan for this compiler; a compile error in our code still fails
        pytest.skip(f"cannot build the AddressSanitizer runner here: {error}")
    return asan, sanitizer_env()


def run_runner(fault_runner, bundle: Path) -> subprocess.CompletedProcess:
    executable, env = fault_runner
    # --switch-repeats 1 loads and runs every expert, so a flipped expert graph is always reached.
    command = [str(executable), "--bundle", str(bundle), "--random", "1", "--iterations", "1", "--warmup", "0"]
    return subprocess.run(
        [*command, "--switch-repeats", "1"], capture_output=True, env=env, timeout=TIMEOUT_S, check=False
    )


def assert_refused(result: subprocess.CompletedProcess, statuses: tuple[int, ...]) -> str:
    stderr = result.stderr.decode("utf-8", errors="replace")
    assert result.returncode >= 0, f"killed by signal {-result.returncode}: {stderr[-2000:]}"
    assert result.returncode in statuses, f"exit status {result.returncode}: {stderr[-2000:]}"
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mobile_moe_runner"), f"stderr is not one runner line: {stderr!r}"
    assert len(lines[0]) < 600
    assert not result.stdout.strip(), "a refused run printed a report"
    return lines[0]


@pytest.mark.parametrize("mutation", sorted(MANIFEST_MUTATIONS))
def test_runner_refuses_manifest_mutation(fault_runner, bundle, tmp_path, mutation):
    broken = copy_bundle(bundle, tmp_path / "bundle")
    mutate_manifest(broken, mutation)
    assert_refused(run_runner(fault_runner, broken), (2,))


AGAIN = "export the bundle again with `mobile-moe export`"


@pytest.mark.parametrize(
    ("stated", "said"),
    [
        (None, f"the bundle is of format version 0 (it states none); this library reads version 2: {AGAIN}"),
        (1, f"the bundle is of format version 1; this library reads version 2: {AGAIN}"),
        (3, "the bundle is of format version 3 (written by a newer mobile-moe); this library reads version 2: upgrade "
            f"libmobile_moe, or {AGAIN}"),  # fmt: skip
    ],
)
def test_the_library_says_which_format_version_a_bundle_holds_and_what_to_do(fault_runner, bundle, tmp_path, stated,
                                                                             said):  # fmt: skip
    """The library words a manifest's version as every Python reader of a format does (mobile_moe/formats/versions.py):
    which version the bundle holds (none: 0), which one it reads, and what to do."""
    broken = copy_bundle(bundle, tmp_path / "bundle")
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest.pop("version")
    if stated is not None:
        manifest["version"] = stated
    write_manifest_text(broken, json.dumps(manifest))
    line = assert_refused(run_runner(fault_runner, broken), (2,))
    assert line.endswith(f"version: {said}"), line


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    return whole_bundle(tmp_path_factory, "executorch")


# The whole bundle's tests are in the slow set: its export takes 15-20 s on 2 cores, and the fast set already runs
# the runner on the split bundle (`bundle`) and the whole manifest's refusals in Python (test_bundle_faults.py).
whole_export = pytest.mark.slow


@whole_export
def test_runner_runs_the_whole_bundle(fault_runner, whole):
    """The unmutated whole bundle runs (so each refusal below is the mutation's doing) and reports the experts its
    image used."""
    result = run_runner(fault_runner, whole)
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    report = json.loads(result.stdout)
    assert report["layout"] == "whole" and report["images"][0]["experts"]


@whole_export
@pytest.mark.parametrize("mutation", sorted(WHOLE_MANIFEST_MUTATIONS))
def test_runner_refuses_whole_manifest_mutation(fault_runner, whole, tmp_path, mutation):
    broken = copy_bundle(whole, tmp_path / "bundle")
    mutate_manifest(broken, mutation, WHOLE_MANIFEST_MUTATIONS)
    assert_refused(run_runner(fault_runner, broken), (2,))


@pytest.mark.parametrize("fault", sorted(RAW_MANIFESTS))
def test_runner_refuses_malformed_json(fault_runner, bundle, tmp_path, fault):
    broken = copy_bundle(bundle, tmp_path / "bundle")
    text = (broken / "manifest.json").read_text()
    changed = RAW_MANIFESTS[fault](json.dumps(json.loads(text)))
    assert changed != json.dumps(json.loads(text)), "precondition: the fault changed the manifest"
    write_manifest_text(broken, changed)
    line = assert_refused(run_runner(fault_runner, broken), (2,))
    assert "manifest.json" in line


@pytest.mark.parametrize(
    ("name", "index", "resealed"), FLIPS, ids=[f"{n}-{i}-{'resealed' if r else 'raw'}" for n, i, r in FLIPS]
)
def test_runner_survives_flipped_graph_byte(fault_runner, bundle, tmp_path, name, index, resealed):
    offset = flip_offsets((bundle / name).stat().st_size, count=FLIP_COUNT, seed=0)[index]
    broken = copy_bundle(bundle, tmp_path / "bundle")
    flip_byte(broken / name, offset)
    if not resealed:
        line = assert_refused(run_runner(fault_runner, broken), (2,))
        assert "sha256" in line and name in line
        return
    reseal(broken)
    result = run_runner(fault_runner, broken)
    # A .ptd's bytes at those offsets may be padding: there, any outcome but a crash.
    if offset in HEADER_OFFSETS and name.endswith(".pte"):
        assert_refused(result, (2,))
    elif result.returncode == 0:  # the flip changed a weight: the program is valid, and runs
        assert isinstance(json.loads(result.stdout), dict)
    else:
        assert_refused(result, (1, 2))


@pytest.mark.slow
@pytest.mark.parametrize("name", FLIP_FILES)
def test_runner_refuses_every_resealed_header_flip_or_answers_as_before(fault_runner, bundle, tmp_path, name):
    """Every byte of the first 64 (identifier, extended header, first tables) flipped, and the manifest re-sealed:
    one line and exit 2, or the byte did not matter and the answer is the untouched bundle's (a segment base moved by
    a byte used to run, and give NaN logits)."""

    def answers(result: subprocess.CompletedProcess) -> list[tuple]:
        return [(image["experts"], image["gates"], image["logits"]) for image in json.loads(result.stdout)["images"]]

    untouched = run_runner(fault_runner, bundle)
    assert untouched.returncode == 0, untouched.stderr.decode(errors="replace")[-2000:]
    for offset in HEADER_BYTES:
        broken = copy_bundle(bundle, tmp_path / f"flip-{offset}")
        flip_byte(broken / name, offset)
        reseal(broken)
        result = run_runner(fault_runner, broken)
        if result.returncode == 0:
            assert answers(result) == answers(untouched), offset
        else:
            assert_refused(result, (2,))


WHOLE_FLIP_COUNT = 4
WHOLE_FLIPS = [(index, resealed) for index in range(4 + WHOLE_FLIP_COUNT) for resealed in (False, True)]


@whole_export
@pytest.mark.parametrize(
    ("index", "resealed"), WHOLE_FLIPS, ids=[f"whole.pte-{i}-{'resealed' if r else 'raw'}" for i, r in WHOLE_FLIPS]
)
def test_runner_survives_flipped_whole_graph_byte(fault_runner, whole, tmp_path, index, resealed):
    """The whole graph's program holds the routing bookkeeping (integer ops on the portable kernels) as well as the
    experts: a flip there must be refused or fail cleanly too, never crash."""
    offset = flip_offsets((whole / "whole.pte").stat().st_size, count=WHOLE_FLIP_COUNT, seed=2)[index]
    broken = copy_bundle(whole, tmp_path / "bundle")
    flip_byte(broken / "whole.pte", offset)
    if not resealed:
        assert "sha256" in assert_refused(run_runner(fault_runner, broken), (2,))
        return
    reseal(broken)
    result = run_runner(fault_runner, broken)
    if offset in HEADER_OFFSETS:
        assert_refused(result, (2,))
    elif result.returncode == 0:
        assert isinstance(json.loads(result.stdout), dict)
    else:
        assert_refused(result, (1, 2))


def test_sha256_matches_hashlib(internal_checks, bundle, tmp_path):
    """The library's own SHA-256 (sha256.h) against hashlib: the standard vectors' lengths around the 55/56/64-byte
    padding boundaries, a million bytes, and the bundle's real files."""
    files = []
    for size in (0, 3, 55, 56, 63, 64, 65, 119, 120, 1_000_000):
        path = tmp_path / f"data_{size}"
        path.write_bytes(b"abc" if size == 3 else (b"a" * size if size == 1_000_000 else os.urandom(size)))
        files.append(path)
    files += sorted(bundle.iterdir())
    command = [str(internal_checks), "--sha256", *map(str, files)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    digests = [line.split("  ", 1)[0] for line in result.stdout.splitlines()]
    assert digests == [hashlib.sha256(path.read_bytes()).hexdigest() for path in files]
    assert digests[1] == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-2 "abc"
    assert digests[9] == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"  # a million "a"


def test_xxh64_matches_the_reference(internal_checks, tmp_path):
    """The XXH64 that checks packed-weight cache files (packed_cache.cpp) against the reference implementation's
    digests (the xxhash package, seed 0): below and above the 32-byte stripe, every tail length, and a file read in
    several windows (packed_cache.cpp's kCheckWindow) hashed as one."""
    cases = {
        b"": "ef46db3751d8e999",
        b"a": "d24ec4f1a98c6e5b",
        b"abc": "44bc2cf5ad770999",
        b"0123456789abc": "ba453e84431e55e5",  # 8 + 4 + 1 tail bytes
        bytes(range(47)): "0d9883a03e7bfbb8",  # one stripe, then 8 + 4 + 3
        bytes(range(256)) * 3 + b"xyz": "e921a1b45bd779f8",
        bytes(range(251)) * 2100 + b"tail": "90f04661ffc2d46d",  # three 256 KiB windows, one hash
    }
    files = []
    for index, data in enumerate(cases):
        files.append(tmp_path / f"case_{index}")
        files[-1].write_bytes(data)
    command = [str(internal_checks), "--xxh64", *map(str, files)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    assert [line.split("  ", 1)[0] for line in result.stdout.splitlines()] == list(cases.values())


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


SETTINGS = RoundSettings(iterations=1, warmup=0, switch_repeats=0)


def test_run_native_refuses_bad_runner_paths(bundle, tmp_path):
    with pytest.raises(UsageError, match="printed nothing"):
        run_native("/bin/false", bundle, None, SETTINGS)
    with pytest.raises(UsageError, match="no such file"):
        run_native(tmp_path / "nonexistent", bundle, None, SETTINGS)
    not_executable = tmp_path / "runner"
    not_executable.write_text("")
    with pytest.raises(UsageError, match="not executable"):
        run_native(not_executable, bundle, None, SETTINGS)


def test_run_native_reports_crashes_and_odd_output_in_one_line(bundle, tmp_path):
    crashing = _script(
        tmp_path, "crashing", 'echo "mobile_moe_runner: crashed (signal 11) while loading x" >&2\nkill -SEGV $$'
    )
    with pytest.raises(UsageError, match=r"crashed \(signal 11") as crash:
        run_native(crashing, bundle, None, SETTINGS)
    assert str(bundle) in str(crash.value) and "\n" not in str(crash.value)
    garbled = _script(tmp_path, "garbled", r"printf 'mobile_moe_runner: bad \377\376 bytes\n' >&2; exit 1")
    with pytest.raises(UsageError, match="bad .* bytes"):
        run_native(garbled, bundle, None, SETTINGS)
    not_json = _script(tmp_path, "not_json", r"printf '\377 not json'")
    with pytest.raises(UsageError, match="no JSON"):
        run_native(not_json, bundle, None, SETTINGS)
    colouring = _script(tmp_path, "colouring", r"printf '\033[31mred\033[0m\n' >&2; exit 1")  # an escape code
    with pytest.raises(UsageError, match=r"failed \(exit status 1\).*'\\x1b\[31mred\\x1b\[0m'") as coloured:
        run_native(colouring, bundle, None, SETTINGS)
    assert "\x1b" not in str(coloured.value)


def test_run_native_checks_sha256_before_the_runner_starts(bundle, tmp_path):
    broken = copy_bundle(bundle, tmp_path / "bundle")
    flip_byte(broken / "expert_1.ptd", 1000)
    marker = tmp_path / "ran"
    spy = _script(tmp_path, "spy", f"touch {marker}\nexit 0")
    with pytest.raises(UsageError, match="sha256"):
        run_native(spy, broken, None, SETTINGS)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", FLIP_FILES)
def test_no_table_entry_read_as_absent_crashes_the_runner(fault_runner, bundle, tmp_path, name):
    """Every entry of every table the check walks zeroed in its vtable (that field read as absent), one at a time, the
    manifest re-sealed: refused in one line (the runner's check, flatbuffer_check.h, or ExecuTorch's own), a clean
    failure, or a run; never a signal. A zeroed named_data in router.pte crashed the runner before it had the check."""
    variants = without_each_entry((bundle / name).read_bytes())
    assert len(variants) > 5
    for i, variant in enumerate(variants):
        broken = copy_bundle(bundle, tmp_path / f"entry-{i}")
        (broken / name).write_bytes(variant)
        reseal(broken)
        result = run_runner(fault_runner, broken)
        if result.returncode == 0:
            assert isinstance(json.loads(result.stdout), dict)
        else:
            assert_refused(result, (1, 2))
