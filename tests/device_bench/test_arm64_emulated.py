"""The emulated ARM64 device: the native runner cross-built for linux-arm64 and run on ARM instructions under
qemu-user, through the same remote flow (push, run, pull, clean up) as a phone.

The tests that build and run ARM64 code are slow and run with `make arm64` (which installs what they need); they skip,
saying what is missing, when the cross toolchain, qemu or executorch's aarch64 wheel is absent. The flow's own logic
(device paths, refusals) is tested here on every run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_model

from mobile_moe.app.cli import main
from mobile_moe.device_bench import arm64
from mobile_moe.device_bench.bench import BenchSettings, choose_runner, parse_device
from mobile_moe.device_bench.native_runner import run_native
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.device_bench.workload import random_workload, write_raw
from mobile_moe.errors import UsageError
from mobile_moe.export.manifest import read_manifest
from mobile_moe.export.manifest_schema import Manifest
from mobile_moe.library import cross

needs_arm64 = pytest.mark.skipif(bool(arm64.missing()), reason=f"no emulated ARM64 device: {arm64.missing()}")
VARIANTS = {  # bundle -> export options
    "fp32-expert-paths": {},
    "fp32-per-block": {"layout": "per-block"},
    "int8-expert-paths": {"quantize": "int8"},
    "int8-per-block": {"quantize": "int8", "layout": "per-block"},
}


def test_arm64_emulated_is_a_device_that_runs_the_native_runner_only(monkeypatch):
    assert parse_device("arm64-emulated") == ("arm64-emulated", None)
    with pytest.raises(UsageError, match="use host, android"):
        parse_device("arm64-emulated:1")
    with pytest.raises(UsageError, match="runs the native runner only"):
        choose_runner("onnxruntime", "arm64-emulated")
    monkeypatch.setattr(arm64, "missing", lambda: ["qemu-aarch64 (Debian package qemu-user-static)"])
    with pytest.raises(UsageError, match=r"needs qemu-aarch64 .*run `make arm64`"):
        BenchSettings(device="arm64-emulated")  # refused before any round


def test_the_emulated_device_touches_nothing_outside_its_own_directory(monkeypatch, tmp_path):
    monkeypatch.setattr(arm64, "require", lambda: None)
    (tmp_path / "bundle").mkdir()
    (tmp_path / "bundle" / "manifest.json").write_text("{}")
    with arm64.EmulatedArm64Device() as device:
        assert device.root.endswith("/data/local/tmp") and Path(device.root).is_dir()
        workdir = f"{device.root}/mobile-moe-test"
        device.make_dir(workdir)
        device.push(tmp_path / "bundle", f"{workdir}/bundle")
        assert Path(f"{workdir}/bundle/manifest.json").read_text() == "{}"
        device.pull(f"{workdir}/bundle/manifest.json", tmp_path / "pulled.json")
        device.pull(f"{workdir}/absent.json", tmp_path / "absent.json")  # a run that wrote nothing: no file
        assert (tmp_path / "pulled.json").read_text() == "{}" and not (tmp_path / "absent.json").exists()
        for outside in (str(tmp_path / "bundle"), f"{workdir}/../../../../.."):
            with pytest.raises(ValueError, match="not a path on the emulated ARM64 device"):
                device.remove(outside)
        assert (tmp_path / "bundle" / "manifest.json").exists()
        device.remove(workdir)
        assert not Path(workdir).exists()
        filesystem = device.filesystem
    assert not filesystem.exists()


@pytest.fixture(scope="module")
def arm64_runner() -> Path:
    return arm64.build_arm64_runner()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def arm64_bundle(request, tmp_path_factory) -> Path:
    from mobile_moe.export.bundle import export_bundle

    out = tmp_path_factory.mktemp("arm64") / request.param
    export_bundle(tiny_model("mobile-vmoe", pool="mean").eval(), out, "executorch", **VARIANTS[request.param])
    return out


def expected_files(manifest: Manifest, chosen: set[int]) -> set[str]:
    """What a run may open: every graph that is not an expert's (router, shared block halves), and the chosen
    experts' (program and weights)."""
    return {
        file.file
        for graph in manifest.graphs
        if graph.expert is None or graph.expert in chosen
        for file in graph.files()
    }


@pytest.mark.slow
@needs_arm64
def test_the_arm64_runner_reproduces_the_host_runner(runner, arm64_runner, arm64_bundle, tmp_path):
    manifest = read_manifest(arm64_bundle, verify_files=True)
    images = write_raw(random_workload(manifest.input.shape, count=6, seed=3), tmp_path / "images.f32")
    settings = RoundSettings(iterations=2, warmup=1, cache_experts=1, switch_repeats=0)
    host = run_native(runner, arm64_bundle, images, settings)
    arm = arm64.run_emulated(arm64_runner, arm64_bundle, images, settings)
    assert "/data/local/tmp/mobile-moe-" in arm["bundle"]  # it ran from the device's copy
    experts = [row["experts"] for row in arm["images"]]
    assert experts == [row["experts"] for row in host["images"]]
    arm_logits, host_logits = (np.array([row["logits"] for row in r["images"]]) for r in (arm, host))
    if arm64_bundle.name.startswith("int8"):  # same classes and experts; XNNPACK's int8 kernels differ by arch
        assert arm_logits.argmax(1).tolist() == host_logits.argmax(1).tolist()
    else:
        np.testing.assert_allclose(arm_logits, host_logits, atol=1e-4)
    chosen = {e for row in experts for e in row}
    assert len(chosen) >= 2, "precondition: the workload should route to several experts"
    assert set(arm["files_opened"]) == set(host["files_opened"]) == expected_files(manifest, chosen)
    # Evicted experts park there as here, none of their packed weights left in memory.
    assert arm["parked_experts"] == host["parked_experts"] and arm["parked_experts"]
    assert arm["parked_packed_bytes_resident"] == host["parked_packed_bytes_resident"] == 0


@pytest.mark.slow
@needs_arm64
def test_bench_on_the_emulated_device_marks_its_latency_emulated(bundle, arm64_runner, tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", str(bundle), "--device", "arm64-emulated", "--iterations", "3", "--warmup", "1", "--rounds", "1"]
    argv += ["--runner", str(arm64_runner)]  # the build the flow would make itself, given explicitly
    assert main([*argv, "--images", "4", "--out", str(out), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    run = results["runs"][0]
    assert run["device"] == "arm64-emulated" and run["emulated"] is True and run["runtime"] == "native"
    assert run["bytes_loaded_per_image"] > 0 and run["cache_hit_rate"]
    parity = run["host_parity"]  # its answers against export's runtime on this host, same images
    assert parity["images"] == 4 and parity["same_class"] == parity["same_experts"] == 4
    assert parity["max_abs_logit_diff"] < 1e-4
    report = (out / "report.md").read_text()
    assert "EMULATED" in report and "not comparable to a phone's" in report
    assert "## ARM64 (emulated) against this host, same images" in report and "| 4/4 | 4/4 |" in report


@pytest.mark.slow
@needs_arm64
def test_an_app_on_the_c_api_cross_built_for_linux_arm64_answers_as_on_the_host(runner, arm64_runner, bundle,
                                                                                 tmp_path):  # fmt: skip
    """libmobile_moe and examples/app_example.c from the linux-arm64 build, run under qemu-user against the aarch64
    wheel's ExecuTorch: the same top class and expert as the host build of the same app, image by image."""
    import subprocess

    manifest = read_manifest(bundle, verify_files=True)
    images = write_raw(random_workload(manifest.input.shape, count=4, seed=3), tmp_path / "images.f32")
    host_app, arm64_app = (binary.parent / "cmake-build" / "mobile_moe_app" for binary in (runner, arm64_runner))
    libraries = [str(cross.runtime_dir())]
    emulated = [arm64.qemu(), "-cpu", arm64.CPU, "-L", str(cross.SYSROOT),
                "-E", f"LD_LIBRARY_PATH={':'.join([str(arm64_app.parent), *libraries])}"]  # fmt: skip
    for index in range(4):
        one = tmp_path / f"image-{index}.f32"
        one.write_bytes(
            images.read_bytes()[index * one_image_bytes(manifest) : (index + 1) * one_image_bytes(manifest)]
        )
        answers = []
        for command in ([str(host_app)], [*emulated, str(arm64_app)]):
            result = subprocess.run([*command, str(bundle), str(one), "--cache-experts", "1", "--iterations", "1"],
                                    capture_output=True, text=True, timeout=300)  # fmt: skip
            assert result.returncode == 0, result.stderr[-2000:]
            report = json.loads(result.stdout)
            answers.append((report["first_class"], report["first_expert"]))
        assert answers[0] == answers[1], index


def one_image_bytes(manifest: Manifest) -> int:
    return 4 * int(np.prod(manifest.input.shape[1:]))


@pytest.mark.slow
@needs_arm64
def test_an_app_built_from_the_linux_arm64_sdk_by_its_readme_answers_as_predict(bundle, tmp_path):
    """`mobile-moe sdk --target linux-arm64`: an app built with the cross compiler by the SDK README's own commands and
    shipped with the libraries beside it runs under qemu-aarch64 with no environment, and answers as predict."""
    import os
    import shutil
    import subprocess

    from mobile_moe.export.runtime import load_bundle
    from mobile_moe.library.sdk import write_sdk

    sdk = write_sdk(tmp_path / "sdk", "linux-arm64")
    readme = (sdk / "README.md").read_text()
    assert "linux-aarch64" in readme and not (sdk / "java").exists()
    assert "Machine:                           AArch64" in subprocess.run(
        ["readelf", "-h", str(sdk / "lib" / "libmobile_moe.so.2")], capture_output=True, text=True, check=True
    ).stdout
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy2(sdk / "examples" / "app_example.c", work / "app.c")
    blocks = [readme.split(f"<!-- sdk-readme: {name} -->\n```sh\n")[1].split("```")[0] for name in ("build", "ship")]
    script = "".join(blocks)
    subprocess.run(["bash", "-euc", script], cwd=work, env={"SDK": str(sdk), "PATH": os.environ["PATH"]}, check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    manifest = read_manifest(bundle, verify_files=True)
    images = write_raw(random_workload(manifest.input.shape, count=4, seed=3), tmp_path / "images.f32")
    emulated = [arm64.qemu(), "-cpu", arm64.CPU, "-L", str(cross.SYSROOT)]
    app = [*emulated, str(work / "dist" / "app"), str(bundle), str(images), "--iterations", "4"]
    app += ["--weight-cache-dir", ""]
    result = subprocess.run(app, env={}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    host = load_bundle(bundle, weight_cache_dir="")
    shape = manifest.input.shape[1:]
    expected = [host.predict(image) for image in np.fromfile(images, np.float32).reshape(-1, *shape)]
    report = json.loads(result.stdout)
    assert report["classes"] == [int(np.argmax(p.logits)) for p in expected]
    assert report["experts"] == [p.experts[0] for p in expected]
