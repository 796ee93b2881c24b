"""mm_prepare does an app's first launch ahead: after it, a new process's open and first predictions map every
graph's packed weights (each load "warm"), as a second launch's do; with packed weights off it is refused."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import needs_build

from mobile_moe.library.binding import LibraryError, load_library

pytestmark = [pytest.mark.export, needs_build]


def test_a_prepared_bundle_opens_and_switches_as_on_a_second_launch(bundle, runner, tmp_path):
    library, folder, seen = load_library(), tmp_path / "packed", []
    library.prepare(bundle, progress=lambda done, total: seen.append((done, total)), weight_cache_dir=str(folder))
    assert seen == [(done, 5) for done in range(1, 6)]  # the open's router, then each of the 4 experts
    command = [str(runner), "--bundle", str(bundle), "--random", "8", "--iterations", "1", "--switch-repeats", "0",
               "--cache-experts", "0", "--weight-cache-dir", str(folder)]  # fmt: skip
    report = json.loads(subprocess.run(command, capture_output=True, check=True).stdout)
    assert {event["graph"] for event in report["loads"]} == {"router", "expert_0", "expert_1", "expert_2", "expert_3"}
    assert {(event["cache"], event["weights"]) for event in report["loads"]} == {("warm", "mapped")}


def test_preparing_with_packed_weights_off_is_refused_in_a_line(bundle):
    with pytest.raises(LibraryError, match="mm_prepare: packed weights are off .* pass a folder"):
        load_library().prepare(bundle, weight_cache_dir="")


def test_the_model_info_says_why_packed_weights_are_off(bundle, tmp_path, monkeypatch):
    from mobile_moe.library.binding import Model

    assert Model(bundle, weight_cache_dir="").info["weight_cache_off"] == 'options.weight_cache_dir is ""'
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MOBILE_MOE_WEIGHT_CACHE", str(tmp_path / "a-file" / "packed"))
    info = Model(bundle).info
    assert info["weight_cache_dir"] == "" and info["weight_cache_off"].startswith(f"per-user folder {tmp_path}")
    assert Model(bundle, weight_cache_dir=str(tmp_path / "on")).info["weight_cache_off"] == ""


def test_preparing_onto_a_full_disk_says_nothing_could_be_kept(bundle, tmp_path):
    """A phone whose storage is full: every graph packs in memory (no signal), and prepare says it kept nothing."""
    from faults import small_file_system

    from mobile_moe.library.binding import LibraryRuntimeError

    with small_file_system(tmp_path / "full", size="64k") as full:
        with pytest.raises(LibraryRuntimeError, match=r"mm_prepare: graph \w+ could not be kept in .*free some space"):
            load_library().prepare(bundle, weight_cache_dir=str(full))


def test_a_bundle_of_two_experts_an_image_is_prepared_with_both_in_memory(tmp_path):
    """top_k = 2: an image needs two experts at once, so preparing keeps two (one at a time would be refused)."""
    from conftest import bundle_images, tiny_model

    from mobile_moe.export.bundle import export_bundle

    export_bundle(tiny_model("mobile-vmoe", pool="mean", top_k=2).eval(), tmp_path / "k2", "executorch",
                  sample_images=bundle_images(6))  # fmt: skip
    seen = []
    load_library().prepare(tmp_path / "k2", progress=lambda done, total: seen.append(done),
                           weight_cache_dir=str(tmp_path / "packed"))  # fmt: skip
    assert seen == [1, 2, 3, 4, 5] and list((tmp_path / "packed").glob("*.xnnpack"))


def test_a_closed_model_refuses_every_call(bundle):
    from conftest import bundle_images

    from mobile_moe.library.binding import Model

    model = Model(bundle, weight_cache_dir="")
    model.close()
    with pytest.raises(LibraryError, match="is closed"):
        model.predict(bundle_images(1)[0])
    with pytest.raises(LibraryError, match="is closed"):
        model.loaded_expert_graphs()
    model.close()  # twice: nothing
