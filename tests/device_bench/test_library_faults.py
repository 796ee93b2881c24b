"""libmobile_moe inside an app's process (tests/library_faults.c, one scenario a run): handles of other thread counts
opened, used and closed in the orders mobile_moe.h allows, from one thread and from several; two handles serving from
two threads at once, bit for bit as one alone; two threads on one handle; double close, calls after close, buffers
shorter than their stride says; an app built when the options struct was smaller. Each holds plain, and (slow set)
under AddressSanitizer and ThreadSanitizer: never a crash, a hang, a sanitizer report or an answer other than the
handle's alone."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import needs_build
from test_native_library import client, images, library  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.export, needs_build]

SCENARIOS = ["pool-order", "one-handle", "two-handles", "open-while-serving", "misuse", "older-app", "log-callback",
             "measure-while-serving"]


@pytest.fixture(scope="session", params=["plain", pytest.param("address", marks=pytest.mark.slow),
                                         pytest.param("thread", marks=pytest.mark.slow)])  # fmt: skip
def faults(request, library):  # noqa: F811 (the imported fixture)
    return client("mobile_moe_library_faults", library, request.param)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_library_survives_what_an_app_may_do(faults, bundle, images, scenario, tmp_path):  # noqa: F811 (images)
    """Each scenario with an empty packed-weight folder of its own (the default one, MOBILE_MOE_WEIGHT_CACHE): its
    handles pack the bundle's graphs there at the same time."""
    binary, env = faults
    env = {**env, "MOBILE_MOE_WEIGHT_CACHE": str(tmp_path / "packed-weights")}
    rounds = "1000" if scenario == "one-handle" else "20"
    result = subprocess.run([str(binary), scenario, str(bundle), str(images), rounds], capture_output=True,
                            text=True, env=env, timeout=600)  # fmt: skip
    if "ThreadSanitizer: unexpected memory mapping" in result.stderr:
        pytest.skip(f"this kernel's address layout defeats ThreadSanitizer: {result.stderr.strip()[:200]}")
    assert result.returncode in (0, 1), result.stderr[-3000:]
    assert "Sanitizer" not in result.stderr, result.stderr[-3000:]
    record = json.loads(result.stdout)
    assert record["ok"], record["detail"]
    assert result.stderr == "", "the library wrote to the app's stderr: " + result.stderr[-2000:]
