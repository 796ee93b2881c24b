"""libmobile_moe's C API (native/mobile_moe.h) from Python through ctypes, as an app calls it: the tests' client.

Run as a program it opens bundles in this process and prints one JSON object per bundle, so a test drives the library
in a child process (a crash inside the runtime fails that test instead of killing pytest):

    python tests/device_bench/c_api.py LIBRARY IMAGES.f32 CACHE_EXPERTS BUNDLE...

Each line: {"bundle", "status", "error", "predictions": [{"logits", "experts", "gates", "top": [[class, p], ...]}]}
for every image of IMAGES.f32 (raw float32, N x C x S x S), or for none when the open was refused.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import numpy as np

MM_OK, MM_BAD_ARGUMENT, MM_BAD_BUNDLE, MM_RUNTIME_ERROR, MM_OUT_OF_MEMORY = range(5)


class Options(ctypes.Structure):
    _fields_ = [("threads", ctypes.c_int), ("cache_experts", ctypes.c_int), ("park_experts", ctypes.c_int),
                ("cache_margin", ctypes.c_float), ("weight_cache_dir", ctypes.c_char_p),
                ("weight_cache_limit_mib", ctypes.c_int), ("prefetch", ctypes.c_int)]  # fmt: skip


class CApi:
    """The library's functions, typed; `open` returns (status, handle)."""

    def __init__(self, library: str | Path):
        self.lib = lib = ctypes.CDLL(str(library))
        lib.mm_version.restype = ctypes.c_char_p
        lib.mm_last_error.restype = ctypes.c_char_p
        lib.mm_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(Options), ctypes.POINTER(ctypes.c_void_p)]
        lib.mm_close.argtypes = [ctypes.c_void_p]
        lib.mm_num_classes.argtypes = [ctypes.c_void_p]
        lib.mm_class_name.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.mm_class_name.restype = ctypes.c_char_p
        lib.mm_predict_f32.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t]
        lib.mm_logits.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t]
        lib.mm_logits.restype = ctypes.c_size_t
        lib.mm_top_classes.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                       ctypes.POINTER(ctypes.c_float)]  # fmt: skip
        lib.mm_experts.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                   ctypes.POINTER(ctypes.c_float)]  # fmt: skip

    def options(self, **values) -> Options:
        options = Options()
        self.lib.mm_default_options(ctypes.byref(options))
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


def main(argv: list[str]) -> None:
    library, images_file, cache_experts, *bundles = argv
    api = CApi(library)
    for bundle in bundles:
        status, handle = api.open(bundle, cache_experts=int(cache_experts))
        record = {"bundle": bundle, "status": status, "error": api.last_error() if status else "", "predictions": []}
        if status == MM_OK:
            channels, size = api.lib.mm_input_channels(handle), api.lib.mm_input_size(handle)
            images = np.fromfile(images_file, dtype=np.float32).reshape(-1, channels, size, size)
            record["predictions"] = [api.predict(handle, image) for image in images]
            api.lib.mm_close(handle)
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
