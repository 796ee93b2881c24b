"""libmobile_moe's C API (include/mobile_moe.h) from Python through ctypes, as an app calls it: the tests' client.

Run as a program it opens bundles in this process and prints one JSON object per bundle, so a test drives the library
in a child process (a crash inside the runtime fails that test instead of killing pytest):

    python tests/device_bench/c_api.py LIBRARY IMAGES.f32 CACHE_EXPERTS [--weight-cache=DIR] BUNDLE...
    python tests/device_bench/c_api.py --preprocess LIBRARY BUNDLE PIXELS.npz
    python tests/device_bench/c_api.py --change-after-open replace|overwrite LIBRARY IMAGES.f32 BUNDLE FILE [SOURCE]
    python tests/device_bench/c_api.py --measure LIBRARY IMAGES.f32 BUNDLE

Each line: {"bundle", "status", "error", "predictions": [{"logits", "experts", "gates", "top": [[class, p], ...]}]}
for every image of IMAGES.f32 (raw float32, N x C x S x S), or for none when the open was refused. With
--preprocess: each (H, W, 3) uint8 array of PIXELS.npz through mm_preprocess_rgb8 and mm_predict_rgb8, written to
PIXELS.npz's name with ".out.npz" as `<key>` (the C x S x S values) and `<key>.logits`. With --change-after-open:
the bundle opened with one expert in memory and none parked, every image predicted, then the bundle's FILE replaced
by SOURCE's bytes (a rename, as an update writes it) or 4 of its bytes overwritten in place, every image predicted
again; one line {"before": [...], "after": [...]}, each prediction as above. With --measure: mobile_moe_measure.h's
calls on a split bundle opened with one expert cached, graph files read (not mapped), and what each returned (one
JSON line: see measure_main).
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import numpy as np

from mobile_moe.library.binding import (  # noqa: F401 (the statuses, for the tests that import them from here)
    MM_BAD_ARGUMENT,
    MM_BAD_BUNDLE,
    MM_OK,
    MM_OUT_OF_MEMORY,
    MM_RUNTIME_ERROR,
    Library,
    LoadEvent,
    LoadSettings,
    ModelInfo,
    Options,
)


class CApi:
    """The library's functions, typed by the Python binding (mobile_moe/library/binding.py), called raw: options
    and arguments go to the C API unchecked, as a C app's would; `open` returns (status, handle)."""

    def __init__(self, library: str | Path):
        self.lib = Library(library).cdll

    def options(self, **values) -> Options:
        options = Options()
        self.lib.mm_options_init(ctypes.byref(options), ctypes.sizeof(Options))  # mm_default_options, inline in C
        for key, value in values.items():
            setattr(options, key, value)
        return options

    def open(self, bundle: str | Path, **options) -> tuple[int, ctypes.c_void_p]:
        handle = ctypes.c_void_p()
        status = self.lib.mm_open(str(bundle).encode(), ctypes.byref(self.options(**options)), ctypes.byref(handle))
        return status, handle

    def last_error(self) -> str:
        return self.lib.mm_last_error().decode()

    def predict(self, handle, image: np.ndarray, top_k: int = 5) -> dict:
        values = np.ascontiguousarray(image, dtype=np.float32).reshape(-1)
        status = self.lib.mm_predict_f32(handle, values.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), values.size)
        if status != MM_OK:
            return {"status": status, "error": self.last_error()}
        classes = self.lib.mm_logits(handle, None, 0)
        logits = (ctypes.c_float * classes)()
        self.lib.mm_logits(handle, logits, classes)
        top, probabilities = (ctypes.c_int * top_k)(), (ctypes.c_float * top_k)()
        n = self.lib.mm_top_classes(handle, top_k, top, probabilities)
        chosen = self.lib.mm_experts(handle, 0, None, None)
        experts, gates = (ctypes.c_int * max(chosen, 1))(), (ctypes.c_float * max(chosen, 1))()
        self.lib.mm_experts(handle, chosen, experts, gates)
        return {"status": MM_OK, "logits": list(logits), "experts": list(experts)[:chosen],
                "gates": list(gates)[:chosen], "top": [[top[i], probabilities[i]] for i in range(n)]}  # fmt: skip

    def preprocess(self, handle, pixels: np.ndarray) -> np.ndarray:
        """(H, W, 3) uint8 -> the C x S x S float32 the library feeds the bundle (a stride one pixel wider)."""
        height, width, _ = pixels.shape
        padded = np.zeros((height, width + 1, 3), dtype=np.uint8)  # a row stride beyond 3 * width, as apps have
        padded[:, :width] = pixels
        channels, size = self.lib.mm_input_channels(handle), self.lib.mm_input_size(handle)
        out = np.zeros(channels * size * size, dtype=np.float32)
        rgb = padded.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        status = self.lib.mm_preprocess_rgb8(handle, rgb, padded.nbytes, width, height, 3 * (width + 1),
                                             out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)  # fmt: skip
        if status != MM_OK:
            raise RuntimeError(self.last_error())
        status = self.lib.mm_predict_rgb8(handle, rgb, padded.nbytes, width, height, 3 * (width + 1))
        if status != MM_OK:
            raise RuntimeError(self.last_error())
        return out.reshape(channels, size, size)


def preprocess_main(library: str, bundle: str, pixels_file: str) -> None:
    api = CApi(library)
    status, handle = api.open(bundle)
    if status != MM_OK:
        raise SystemExit(api.last_error())
    results = {}
    for key, pixels in np.load(pixels_file).items():
        results[key] = api.preprocess(handle, pixels)
        classes = api.lib.mm_logits(handle, None, 0)
        logits = np.zeros(classes, dtype=np.float32)
        api.lib.mm_logits(handle, logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), classes)
        results[f"{key}.logits"] = logits
    api.lib.mm_close(handle)
    np.savez(pixels_file.removesuffix(".npz") + ".out.npz", **results)


def change_after_open_main(how: str, library: str, images_file: str, bundle: str, file: str, source: str = "") -> None:
    api = CApi(library)
    status, handle = api.open(bundle, cache_experts=1, park_experts=0)
    if status != MM_OK:
        raise SystemExit(api.last_error())
    channels, size = api.lib.mm_input_channels(handle), api.lib.mm_input_size(handle)
    images = np.fromfile(images_file, dtype=np.float32).reshape(-1, channels, size, size)
    before = [api.predict(handle, image) for image in images]
    target = Path(bundle) / file
    if how == "replace":
        staged = target.with_name(target.name + ".new")
        staged.write_bytes(Path(bundle, source).read_bytes())
        staged.replace(target)
    else:
        with open(target, "r+b") as out:
            out.seek(target.stat().st_size // 2)
            out.write(b"\x7f\x7f\x7f\x7f")
    after = [api.predict(handle, image) for image in images]
    api.lib.mm_close(handle)
    print(json.dumps({"before": before, "after": after}), flush=True)


def measure_main(library: str, images_file: str, bundle: str) -> None:
    """The handle opened keeping one load's event (kept_loads 1): {"info": mm_get_model_info's fields,
    "run_before_route": [status, message], "open": [mm_open's loads, the graph of its last], "switch": {"loads": how
    many a switch to expert 0 made, "last": the graph of its last, "loaded": mm_loaded_graphs after it, "load_ms",
    "run_ms"}, "dropped": [status, message] of reading load 0, "out_of_range" and "flags": [status, message]}"""
    api = CApi(library)
    settings = LoadSettings()
    api.lib.mm_load_settings_init(ctypes.byref(settings), ctypes.sizeof(LoadSettings))
    settings.read_files, settings.kept_loads = 1, 1
    handle = ctypes.c_void_p()
    options = api.options(cache_experts=1)
    if api.lib.mm_open_with(bundle.encode(), ctypes.byref(options), ctypes.byref(settings), ctypes.byref(handle)):
        raise SystemExit(api.last_error())
    info = ModelInfo()
    api.lib.mm_model_info_get(handle, ctypes.byref(info), ctypes.sizeof(ModelInfo))
    channels, size = api.lib.mm_input_channels(handle), api.lib.mm_input_size(handle)
    image = np.ascontiguousarray(np.fromfile(images_file, dtype=np.float32)[: channels * size * size])
    pointer = image.ctypes.data_as(ctypes.POINTER(ctypes.c_float))

    def outcome(status: int) -> list:
        return [status, api.last_error() if status else ""]

    def last_load() -> str:
        event = LoadEvent()
        index = api.lib.mm_load_count(handle) - 1
        assert api.lib.mm_load_event_get(handle, index, ctypes.byref(event), ctypes.sizeof(LoadEvent)) == MM_OK
        return event.graph.decode()

    record = {"info": {name: getattr(info, name) for name, _ in ModelInfo._fields_[1:]}}
    record["info"] = {
        key: value.decode() if isinstance(value, bytes) else value for key, value in record["info"].items()
    }
    record["run_before_route"] = outcome(api.lib.mm_expert_run(handle, 0, None))
    first = api.lib.mm_load_count(handle)
    record["open"] = [first, last_load()]
    load_ms, run_ms = ctypes.c_double(-1), ctypes.c_double(-1)
    api.lib.mm_route_f32(handle, pointer, image.size)
    api.lib.mm_expert_unload(handle, 0)
    statuses = [api.lib.mm_expert_load(handle, 0, 0, ctypes.byref(load_ms)),
                api.lib.mm_expert_run(handle, 0, ctypes.byref(run_ms))]  # fmt: skip
    names = (ctypes.c_char_p * 16)()
    loaded = api.lib.mm_loaded_graphs(handle, 16, names)
    record["switch"] = {"statuses": statuses, "loads": api.lib.mm_load_count(handle) - first, "last": last_load(),
                        "load_ms": load_ms.value, "run_ms": run_ms.value,
                        "loaded": [names[i].decode() for i in range(loaded)]}  # fmt: skip
    record["dropped"] = outcome(
        api.lib.mm_load_event_get(handle, 0, ctypes.byref(LoadEvent()), ctypes.sizeof(LoadEvent))
    )
    record["out_of_range"] = outcome(api.lib.mm_expert_load(handle, info.num_experts, 0, None))
    record["flags"] = outcome(api.lib.mm_expert_load(handle, 0, 8, None))
    api.lib.mm_close(handle)
    print(json.dumps(record), flush=True)


def main(argv: list[str]) -> None:
    if argv[0] == "--preprocess":
        preprocess_main(*argv[1:])
        return
    if argv[0] == "--change-after-open":
        change_after_open_main(*argv[1:])
        return
    if argv[0] == "--measure":
        measure_main(*argv[1:])
        return
    library, images_file, cache_experts, *bundles = argv
    weight_cache = None
    if bundles and bundles[0].startswith("--weight-cache="):
        weight_cache = bundles.pop(0).partition("=")[2].encode()
    api = CApi(library)
    for bundle in bundles:
        status, handle = api.open(bundle, cache_experts=int(cache_experts), weight_cache_dir=weight_cache)
        record = {"bundle": bundle, "status": status, "error": api.last_error() if status else "", "predictions": []}
        if status == MM_OK:
            channels, size = api.lib.mm_input_channels(handle), api.lib.mm_input_size(handle)
            images = np.fromfile(images_file, dtype=np.float32).reshape(-1, channels, size, size)
            record["predictions"] = [api.predict(handle, image) for image in images]
            api.lib.mm_close(handle)
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
