"""libmobile_moe, the runtime as a library an app links (include/mobile_moe.h): its C API answers as the Python runtime
does, refuses every bad manifest the runner refuses with the runner's own words, exports nothing but its API, and its
Java binding (org.mobilemoe.MobileMoe, over JNI) answers the same. The library is driven in a child process
(tests/device_bench/c_api.py): a crash inside it fails the test instead of killing pytest."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from c_api import MM_BAD_ARGUMENT, MM_BAD_BUNDLE, MM_OK
from conftest import needs_build
from faults import MANIFEST_MUTATIONS, copy_bundle, mutate_manifest

from mobile_moe.device_bench.workload import random_workload, write_raw
from mobile_moe.export.manifest import read_manifest
from mobile_moe.library.build import JNI_LIBRARY_NAME, SOURCE_DIR, build_library

pytestmark = [pytest.mark.export, needs_build]
DRIVER = Path(__file__).with_name("c_api.py")


@pytest.fixture(scope="session")
def library(runner) -> Path:  # `runner`: the build, or the reason it cannot be built here
    return build_library()


@pytest.fixture(scope="session")
def images(bundle, tmp_path_factory) -> Path:
    workload = random_workload(read_manifest(bundle, verify_files=True).input.shape, count=8, seed=3)
    return write_raw(workload, tmp_path_factory.mktemp("c-api") / "images.f32")


def drive(library: Path, images: Path, bundles: list[Path], cache_experts: int = 1) -> list[dict]:
    result = subprocess.run([sys.executable, str(DRIVER), str(library), str(images), str(cache_experts),
                             *map(str, bundles)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, f"the driver died ({result.returncode}): {result.stderr[-2000:]}"
    return [json.loads(line) for line in result.stdout.splitlines()]


def python_predictions(bundle: Path, images: Path):
    from mobile_moe.export.runtime import load_bundle

    shape = read_manifest(bundle, verify_files=True).input.shape
    runtime = load_bundle(bundle)
    return [runtime.predict(image) for image in np.fromfile(images, dtype=np.float32).reshape(-1, *shape[1:])]


def test_the_library_exports_its_c_api_and_nothing_else(library):
    """Every exported symbol is declared in a public header (include/), and each header's calls are exported."""
    header = "\n".join(path.read_text() for path in sorted((SOURCE_DIR / "include").glob("*.h")))
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in symbols.stdout.splitlines() if line.strip()}
    declared = {name for name in exported if f" {name}(" in header}
    assert (
        exported == declared and {"mm_open", "mm_predict_f32", "mm_close", "mm_open_with", "mm_expert_load"} <= exported
    )


@pytest.mark.parametrize("cache_experts", [1, 0], ids=["one-expert", "every-expert"])
def test_the_c_api_answers_as_the_python_runtime(library, bundle, images, cache_experts):
    (record,) = drive(library, images, [bundle], cache_experts)
    assert record["status"] == MM_OK, record["error"]
    expected = python_predictions(bundle, images)
    for got, want in zip(record["predictions"], expected, strict=True):
        np.testing.assert_allclose(got["logits"], want.logits.reshape(-1), atol=1e-5)
        assert got["experts"] == [int(e) for e in want.experts]
        np.testing.assert_allclose(got["gates"], want.gates, atol=1e-6)
        logits = np.asarray(got["logits"], dtype=np.float64)
        probabilities = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        assert [c for c, _ in got["top"]] == np.argsort(-probabilities, kind="stable")[:5].tolist()
        np.testing.assert_allclose([p for _, p in got["top"]], np.sort(probabilities)[::-1][:5], rtol=1e-6)


def client(program: str, library: Path, sanitizer: str) -> tuple[Path, dict[str, str]]:
    """A C client of the library built beside it (`program`) and the environment to run it in: the normal build
    ("plain"), or the client and the library built with `sanitizer` (skipped where this compiler has none)."""
    from mobile_moe.library.build import SanitizerUnavailable, sanitizer_env

    if sanitizer == "plain":
        return library.parent / program, dict(os.environ)
    try:
        instrumented = build_library(sanitize=sanitizer)
    except SanitizerUnavailable as error:
        pytest.skip(f"cannot build the {sanitizer} sanitizer library here: {error}")
    return instrumented.parent / program, sanitizer_env()


def runner_refusal(runner: Path, bundle: Path) -> str:
    result = subprocess.run([str(runner), "--bundle", str(bundle), "--random", "1", "--iterations", "1"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2, result.stderr
    return result.stderr.strip().removeprefix("mobile_moe_runner: ")


def test_every_client_includes_the_public_headers_alone():
    """The runner, the example app, the JNI binding and the fault harness use the library as an app does: each quoted
    include is a public header (include/) or a file of the client's own folder (the runner's report writer)."""
    public = {path.name for path in (SOURCE_DIR / "include").glob("*.h")}
    clients = [*SOURCE_DIR.glob("runner/*.cpp"), *SOURCE_DIR.glob("examples/*.c"), *SOURCE_DIR.glob("java/*.c"),
               SOURCE_DIR / "tests" / "library_faults.c"]  # fmt: skip
    assert len(clients) >= 4
    for client in clients:
        for name in re.findall(r'^#include "([^"]+)"', client.read_text(), flags=re.MULTILINE):
            assert name in public or (client.parent / name).is_file(), f"{client.name} includes {name}"


def test_the_measurement_calls_switch_an_expert_step_by_step_and_refuse_what_they_cannot_do(library, bundle, images):
    """mobile_moe_measure.h, as the runner drives it: the handle's info is the manifest's, a switch (unload, load, run)
    loads exactly the expert's graphs and leaves them the only ones loaded, the loads beyond kept_loads are counted
    but not kept, and a run before any routing, an expert out of range and an unknown flag are refused in a line
    naming the call."""
    manifest = read_manifest(bundle, verify_files=True)
    result = subprocess.run([sys.executable, str(DRIVER), "--measure", str(library), str(images), str(bundle)],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads(result.stdout)
    info = record["info"]
    resolved = [info[key] for key in ("kind", "kind_name", "num_experts", "top_k", "cache_experts", "graphs")]
    assert resolved == [0, "split", manifest.num_experts, manifest.top_k, 1, len(manifest.graphs)]  # 0: MM_BUNDLE_SPLIT
    assert Path(info["bundle_dir"]) == bundle.resolve() and info["resident_load_ms"] > 0
    expert_graphs = [graph.name for graph in manifest.graphs if graph.expert == 0]
    assert record["open"][0] >= 1 and record["open"][1] not in expert_graphs
    switch = record["switch"]
    assert switch["statuses"] == [MM_OK, MM_OK] and switch["load_ms"] > 0 and switch["run_ms"] > 0
    assert (switch["loads"], switch["last"]) == (len(expert_graphs), expert_graphs[-1])
    assert switch["loaded"] == expert_graphs
    # kept_loads 1: the open's first load is counted but no longer kept (an app's record stays bounded)
    assert record["dropped"][0] == MM_BAD_ARGUMENT and "load 0 is no longer kept" in record["dropped"][1]
    assert record["run_before_route"][0] == MM_BAD_ARGUMENT
    assert (
        record["run_before_route"][1].startswith("mm_expert_run: ")
        and "mm_route_f32 first" in record["run_before_route"][1]
    )
    assert (
        record["out_of_range"][0] == MM_BAD_ARGUMENT
        and f"expert {manifest.num_experts} is out of range" in record["out_of_range"][1]
    )
    assert record["flags"] == [MM_BAD_ARGUMENT, "mm_expert_load: flags are 0 or MM_LOAD_COLD, not 8"]


def test_every_bad_manifest_the_runner_refuses_the_c_api_refuses_in_its_words(library, runner, bundle, images,
                                                                               tmp_path):  # fmt: skip
    broken = []
    for mutation in sorted(MANIFEST_MUTATIONS):
        copy = copy_bundle(bundle, tmp_path / mutation)
        mutate_manifest(copy, mutation)
        broken.append(copy)
    missing = tmp_path / "no-manifest"
    missing.mkdir()
    for record, path in zip(drive(library, images, [*broken, missing]), [*broken, missing], strict=True):
        assert record["status"] == MM_BAD_BUNDLE, (path.name, record)
        assert record["error"] == "mm_open: " + runner_refusal(runner, path), path.name  # the call, then the words


def test_files_verified_once_are_remembered_and_a_file_changed_since_is_verified_again(library, bundle, images,
                                                                                       tmp_path):  # fmt: skip
    """With a packed-weight cache folder, every graph file hashed and checked at the first open is remembered there
    (an app's next cold start does not hash the bundle again); a file written since (a flipped byte, whatever its
    size and modification time) is hashed again and refused."""
    from faults import flip_byte

    copy = copy_bundle(bundle, tmp_path / "bundle")
    cache = tmp_path / "packed-weights"
    cache.mkdir()
    flag = f"--weight-cache={cache}"
    first, again = drive(library, images, [flag, copy, copy])
    assert first["status"] == again["status"] == MM_OK and again["predictions"] == first["predictions"]
    graph_files = {f.file for g in read_manifest(copy).graphs for f in g.files()}
    remembered = (cache / "verified-files.txt").read_text().splitlines()
    assert len(remembered) == len(graph_files)
    weights = copy / "expert_1.ptd"
    stamp = weights.stat()
    flip_byte(weights, weights.stat().st_size // 2)
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # the same size and modification time
    (refused,) = drive(library, images, [flag, copy])
    assert refused["status"] == MM_BAD_BUNDLE and "expert_1.ptd does not match the sha256" in refused["error"]


@pytest.mark.parametrize("how", ["replace", "overwrite"])
def test_a_file_changed_after_open_is_refused_when_it_loads_never_run(library, bundle, images, tmp_path, how):
    """An expert's weights replaced by another expert's (an app update's rename) or 4 bytes written in place, after
    mm_open: each later prediction is the one before the change, or MM_BAD_BUNDLE naming the file when its expert has
    to load again (one expert in memory, none parked, so every switch loads). Never a different answer with MM_OK."""
    copy = copy_bundle(bundle, tmp_path / "bundle")
    result = subprocess.run([sys.executable, str(DRIVER), "--change-after-open", how, str(library), str(images),
                             str(copy), "expert_1.ptd", "expert_0.ptd"], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads(result.stdout)
    refused = [p for p in record["after"] if p["status"] != MM_OK]
    assert refused, "no prediction loaded the changed file: the test does not test it"
    for was, now in zip(record["before"], record["after"], strict=True):
        if now["status"] == MM_OK:
            assert now == was
        else:
            assert now["status"] == MM_BAD_BUNDLE and "expert_1.ptd changed since the bundle was opened" in now["error"]


def test_a_missing_weights_file_is_refused_before_anything_loads(library, bundle, images, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(bundle, broken)
    (broken / "expert_1.ptd").unlink()
    (record,) = drive(library, images, [broken])
    assert record["status"] == MM_BAD_BUNDLE and "expert_1.ptd" in record["error"]


def with_input_resize(bundle: Path, to: Path, resize: dict) -> Path:
    """A copy of `bundle` whose manifest records another input.resize (the graphs are the same, their checksums too)."""
    copy = copy_bundle(bundle, to)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["input"]["resize"] = resize
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


RESIZES = {
    "stretch": {"policy": "stretch"},
    "resize-center-crop": {"policy": "resize-center-crop", "resize_to": 37, "crop_to": 32},
    "bicubic-crop": {"policy": "resize-center-crop", "resize_to": 45, "crop_to": 32, "interpolation": "bicubic"},
}


@pytest.mark.parametrize("resize", sorted(RESIZES))
def test_the_c_preprocessing_gives_the_pythons_values_to_the_last_bit(library, bundle, tmp_path, resize):
    """8-bit RGB pixels through mm_preprocess_rgb8 against mobile_moe.preprocess's eval transform on the same image
    (a file's PIL image, as predict and evaluation read it): the same float32 values, for real photographs cut at
    sizes that shrink, enlarge, stretch and crop on odd pixel counts; mm_predict_rgb8's logits are mm_predict_f32's."""
    from photos import photographs
    from PIL import Image

    from mobile_moe.export.images import preprocess

    copy = with_input_resize(bundle, tmp_path / "bundle", RESIZES[resize])
    transform = preprocess(read_manifest(copy).input)
    photos = [np.asarray(photo) for photo in photographs()]
    pixels = {"china-500x375": photos[0][:375, :500], "flower-31x47": photos[1][100:147, 200:231],
              "hopper-whole": photos[2], "tiny-3x2": photos[0][:2, :3],
              "wide-640x33": photos[1][:33, :640]}  # fmt: skip
    np.savez(tmp_path / "pixels.npz", **pixels)
    result = subprocess.run([sys.executable, str(DRIVER), "--preprocess", str(library), str(copy),
                             str(tmp_path / "pixels.npz")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    got = np.load(tmp_path / "pixels.out.npz")
    runtime_logits = []
    for key, image in pixels.items():
        expected = transform(Image.fromarray(np.ascontiguousarray(image))).numpy()
        assert got[key].shape == expected.shape and np.array_equal(got[key], expected), key
        runtime_logits.append(got[f"{key}.logits"])
    inputs = [transform(Image.fromarray(np.ascontiguousarray(image))).numpy() for image in pixels.values()]
    want = python_predictions_of(bundle, np.stack(inputs))
    for logits, prediction in zip(runtime_logits, want, strict=True):
        np.testing.assert_allclose(logits, prediction.logits.reshape(-1), atol=1e-5)


def test_a_resize_at_the_schemas_bound_of_a_long_thin_image_is_refused_naming_its_size(library, bundle, tmp_path):
    """resize_to 65536 (the schema's bound) of a 32768 x 1 image: 2^31 x 65536 pixels, an int overflow once; now one
    line naming the sizes, MM_BAD_ARGUMENT."""
    copy = with_input_resize(bundle, tmp_path / "bundle",
                             {"policy": "resize-center-crop", "resize_to": 65536, "crop_to": 32})  # fmt: skip
    np.savez(tmp_path / "pixels.npz", thin=np.zeros((1, 32768, 3), dtype=np.uint8))
    result = subprocess.run([sys.executable, str(DRIVER), "--preprocess", str(library), str(copy),
                             str(tmp_path / "pixels.npz")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 1 and "Traceback" in result.stderr  # the driver's RuntimeError: the library refused
    assert "mm_preprocess_rgb8: a 32768 x 1 image resized to 65536 on its shorter side" in result.stderr
    assert "2147483648 x 65536 pixels" in result.stderr


def python_predictions_of(bundle: Path, images: np.ndarray):
    from mobile_moe.export.runtime import load_bundle

    runtime = load_bundle(bundle)
    return [runtime.predict(image) for image in images]


JAVA_MAIN = """
import org.mobilemoe.MobileMoe;
import org.mobilemoe.MobileMoeException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.concurrent.CountDownLatch;

public class PredictMain {
  static String logits(MobileMoe.Prediction p) {
    StringBuilder out = new StringBuilder();
    for (float logit : p.logits) out.append(' ').append(logit);
    return out.toString();
  }

  static String outcome(Runnable call) {
    try {
      call.run();
      return "ok";
    } catch (RuntimeException error) {
      return error.getClass().getSimpleName();
    }
  }

  // A close from this thread while another predicts on and on: IllegalStateException. A close that lands between two
  // predictions is allowed to succeed (the other thread then stops on its IllegalStateException), so up to 5 tries.
  static volatile boolean stop;

  static String closeWhilePredicting(String bundle, MobileMoe.Options options, float[] image) throws Exception {
    String closing = "never tried";
    for (int attempt = 0; attempt < 5 && !closing.equals("IllegalStateException"); ++attempt) {
      MobileMoe model = MobileMoe.open(bundle, options);
      CountDownLatch predicting = new CountDownLatch(1);
      stop = false;
      Thread busy = new Thread(() -> {
        try {
          while (!stop) {
            predicting.countDown();
            model.predict(image, 1);
          }
        } catch (IllegalStateException closed) {
        }
      });
      busy.start();
      predicting.await();
      Thread.sleep(5);
      closing = outcome(model::close);
      stop = true;
      busy.join();
      model.close();
    }
    return closing;
  }

  public static void main(String[] args) throws Exception {
    // args: BUNDLE IMAGES.f32 DAMAGED_BUNDLE PHOTO.rgb WIDTH HEIGHT WEIGHT_CACHE
    ByteBuffer raw = ByteBuffer.wrap(Files.readAllBytes(Paths.get(args[1]))).order(ByteOrder.LITTLE_ENDIAN);
    MobileMoe.Options options = new MobileMoe.Options().cacheExperts(1).weightCacheDir(args[6]);
    try (MobileMoe model = MobileMoe.open(args[0], options)) {
      int values = model.inputValues();
      while (raw.remaining() >= 4 * values) {
        float[] chw = new float[values];
        raw.asFloatBuffer().get(chw);
        raw.position(raw.position() + 4 * values);
        MobileMoe.Prediction p = model.predict(chw, 3);
        String name = model.className(p.classes[0]);
        System.out.println("f32 " + p.classes[0] + " " + name + " " + p.experts[0] + logits(p));
      }
      int width = Integer.parseInt(args[4]), height = Integer.parseInt(args[5]);
      byte[] rgb = Files.readAllBytes(Paths.get(args[3]));
      int[] argb = new int[width * height];
      for (int i = 0; i < argb.length; ++i)
        argb[i] = 0xff000000 | (rgb[3 * i] & 0xff) << 16 | (rgb[3 * i + 1] & 0xff) << 8 | (rgb[3 * i + 2] & 0xff);
      System.out.println("rgb" + logits(model.predictRgb(rgb, width, height, 3 * width, 5)));
      System.out.println("argb" + logits(model.predictArgb(argb, width, height, width, 5)));
      float[] image = new float[values];
      System.out.println("top0 " + model.predict(image, 0).classes.length);
      System.out.println("className " + outcome(() -> model.className(model.numClasses())));
      System.out.println("short " + outcome(() -> model.predictRgb(rgb, width, height + 1, 3 * width, 1)));
      System.out.println("stride " + outcome(() -> model.predictArgb(argb, width, height, width - 1, 1)));
      System.out.println("topK " + outcome(() -> model.predict(image, -1)));
      System.out.println("closeWhilePredicting " + closeWhilePredicting(args[0], options, image));
      model.close();
      System.out.println("afterClose " + outcome(() -> model.predict(image, 1)));
      model.close();
    }
    try {
      MobileMoe.open(args[2], options);
    } catch (MobileMoeException refused) {
      System.out.println("refused " + refused.status() + ": " + refused.getMessage());
    }
    System.out.println("version " + MobileMoe.version());
  }
}
"""


def test_the_java_binding_answers_as_the_python_runtime_and_behaves_as_android_expects(library, bundle, images,
                                                                                         tmp_path):  # fmt: skip
    """f32, RGB bytes and ARGB ints (Bitmap.getPixels' format) through the library's preprocessing, as Python's on the
    same photograph; a bundle folder named with a character outside the Basic Multilingual Plane; topK 0, indices and
    buffers out of range, close while another thread predicts, use after close; a damaged bundle's typed exception."""
    if shutil.which("javac") is None or not (library.parent / JNI_LIBRARY_NAME).is_file():
        pytest.skip("no JDK here (javac; on a fresh machine `apt-get install openjdk-17-jdk-headless`)")
    from photos import photographs
    from PIL import Image

    from mobile_moe.export.images import preprocess

    classes = tmp_path / "classes"
    (tmp_path / "PredictMain.java").write_text(JAVA_MAIN)
    binding = sorted(map(str, (SOURCE_DIR / "java" / "org" / "mobilemoe").glob("*.java")))
    sources = [*binding, str(tmp_path / "PredictMain.java")]
    subprocess.run(["javac", "-d", str(classes), *sources], check=True, capture_output=True, timeout=120)
    photo = np.ascontiguousarray(np.asarray(photographs()[1])[100:147, 200:231])  # 31 x 47, odd sizes
    (tmp_path / "photo.rgb").write_bytes(photo.tobytes())
    emoji = copy_bundle(bundle, tmp_path / "bündle-\U0001f600")
    java = ["java", f"-Djava.library.path={library.parent}", "-cp", str(classes), "PredictMain"]
    result = subprocess.run([*java, str(emoji), str(images), str(tmp_path), str(tmp_path / "photo.rgb"),
                             str(photo.shape[1]), str(photo.shape[0]), str(tmp_path / "packed")],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    names = read_manifest(bundle).class_names
    f32 = [line.split(" ")[1:] for line in lines if line.startswith("f32 ")]
    for (index, name, expert, *logits), want in zip(f32, python_predictions(bundle, images), strict=True):
        assert int(index) == int(np.argmax(want.logits)) and name == names[int(index)]
        assert int(expert) == int(want.experts[0])
        np.testing.assert_allclose(np.array(logits, dtype=np.float32), want.logits.reshape(-1), atol=1e-5)
    photo_input = preprocess(read_manifest(bundle).input)(Image.fromarray(photo))[None].numpy()
    (want,) = python_predictions_of(bundle, photo_input)
    for kind in ("rgb", "argb"):
        (line,) = [line for line in lines if line.startswith(f"{kind} ")]
        np.testing.assert_allclose(np.array(line.split()[1:], dtype=np.float32), want.logits.reshape(-1), atol=1e-5)
    said = dict(line.split(" ", 1) for line in lines if not line.startswith(("f32 ", "rgb ", "argb ")))
    assert said["top0"] == "0" and said["className"] == "IndexOutOfBoundsException"
    assert said["short"] == "IndexOutOfBoundsException" and said["stride"] == "IllegalArgumentException"
    assert said["topK"] == "IllegalArgumentException" and said["afterClose"] == "IllegalStateException"
    assert said["closeWhilePredicting"] == "IllegalStateException"
    assert said["refused"].startswith("BAD_BUNDLE: mm_open: ") and "manifest.json" in said["refused"]
    assert said["version"].startswith("mobile-moe libmobile_moe 2.")
    assert result.stderr == ""


@pytest.fixture(scope="session", params=["plain", pytest.param("address", marks=pytest.mark.slow)])
def app(request, library) -> tuple[Path, dict[str, str]]:
    """examples/app_example.c (an app's whole use of the C API): plain, and under AddressSanitizer."""
    return client("mobile_moe_app", library, request.param)


@pytest.mark.slow  # a process per damaged bundle: 96 of them
def test_an_app_on_a_damaged_bundle_gets_one_message_never_a_crash(app, bundle, images, tmp_path):
    """Every byte flip of the runner's fault tests (router, the experts' shared program, expert 0's weights), raw and
    with the manifest re-sealed, through the C API in an app's process (no forked probe): refused with one line and
    exit 2, a clean runtime failure (1), or, when the flip changed only weights, answers; never a signal, never an
    AddressSanitizer report."""
    from faults import flip_byte, flip_offsets, reseal
    from test_native_faults import FLIP_COUNT, FLIP_FILES

    binary, env = app
    for name in FLIP_FILES:
        for index, offset in enumerate(flip_offsets((bundle / name).stat().st_size, count=FLIP_COUNT, seed=0)):
            for resealed in (False, True):
                broken = copy_bundle(bundle, tmp_path / f"{name}-{index}-{resealed}")
                flip_byte(broken / name, offset)
                if resealed:
                    reseal(broken)
                result = subprocess.run([str(binary), str(broken), str(images), "--cache-experts", "1"],
                                        capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
                case = f"{name} byte {offset} {'resealed' if resealed else 'raw'}: {result.stderr[-1500:]}"
                assert result.returncode in (0, 1, 2), case
                if result.returncode:
                    ours = [line for line in result.stderr.splitlines() if line.startswith("mobile_moe_app: ")]
                    assert len(ours) == 1, case
                    assert resealed or "sha256" in ours[0], case
                shutil.rmtree(broken)
