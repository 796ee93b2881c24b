"""libmobile_moe inside an app's process (tests/library_faults.c, one scenario a run): handles of other thread counts
opened, used and closed in the orders mobile_moe.h allows, from one thread and from several; two handles serving from
two threads at once, bit for bit as one alone; two threads on one handle; double close, calls after close, buffers
shorter than their stride says; an app built when the options struct was smaller; hostile storage (a full disk under
the packed-weight folder, a per-user folder that cannot be used, what a killed process left in the folder) and
capacities of INT_MAX. Each holds plain, and (slow set) under AddressSanitizer and ThreadSanitizer: never a crash, a
hang, a sanitizer report or an answer other than the handle's alone."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import needs_build
from faults import small_file_system
from test_native_library import client, images, library  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.export, needs_build]

SCENARIOS = ["pool-order", "one-handle", "two-handles", "open-while-serving", "misuse", "older-app", "log-callback",
             "measure-while-serving", "stray-files", "top-k", "shared-handle-results"]


@pytest.fixture(scope="session", params=["plain", pytest.param("address", marks=pytest.mark.slow),
                                         pytest.param("thread", marks=pytest.mark.slow)])  # fmt: skip
def faults(request, library):  # noqa: F811 (the imported fixture)
    return client("mobile_moe_library_faults", library, request.param)


def run_scenario(faults, bundle, images, scenario: str, env: dict[str, str | None]) -> None:  # noqa: F811 (images)
    """`scenario` with `env` over the client's environment (None: a variable removed)."""
    binary, base = faults
    env = {name: value for name, value in {**base, **env}.items() if value is not None}
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


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_library_survives_what_an_app_may_do(faults, bundle, images, scenario, tmp_path):  # noqa: F811 (images)
    """Each scenario with an empty packed-weight folder of its own (the default one, MOBILE_MOE_WEIGHT_CACHE): its
    handles pack the bundle's graphs there at the same time."""
    run_scenario(faults, bundle, images, scenario, {"MOBILE_MOE_WEIGHT_CACHE": str(tmp_path / "packed-weights")})


def test_a_full_disk_under_the_packed_weights_packs_in_memory(faults, bundle, images, tmp_path):  # noqa: F811
    """A 256 KiB tmpfs, a phone whose storage is full, as the default folder and as the app's: every open answers
    exactly and says in the log that there is no room, where the backend writing its file through a mapping died of
    SIGBUS."""
    with small_file_system(tmp_path / "full") as full:
        run_scenario(faults, bundle, images, "full-disk", {"MOBILE_MOE_WEIGHT_CACHE": str(full)})
        assert not [path.name for path in full.iterdir() if ".tmp-" in path.name]  # nothing staged left behind


def test_a_per_user_folder_that_cannot_be_used_is_off_not_a_refusal(faults, bundle, images, tmp_path):  # noqa: F811
    """XDG_CACHE_HOME long enough that the packed-weight paths under it pass XNNPACK's 255 characters: the default
    folder is off with a line, the same folder chosen by the app is refused."""
    xdg = tmp_path / ("x" * (171 - len(str(tmp_path)) - 1))
    xdg.mkdir()
    env = {"XDG_CACHE_HOME": str(xdg), "MOBILE_MOE_WEIGHT_CACHE": None, "MOBILE_MOE_CACHE": None}
    run_scenario(faults, bundle, images, "derived-folder", env)
    assert list(xdg.iterdir()) == []
