"""libmobile_moe from Python: its C API (include/mobile_moe.h, and what mobile_moe_measure.h tells of a handle) through
ctypes, as llama-cpp-python binds llama.h. The toolkit runs every ExecuTorch bundle through it (predict, bench's
in-process runtime, export's parity and top-1, the demo), so what Python answers is what an app linking the library
answers, and a Python app on a Linux device uses the same library.

    from mobile_moe.library.binding import Model

    with Model("bundles/photos-moe", cache_experts=1) as model:   # libmobile_moe's options, by name (options.py)
        prediction = model.predict_file("photo.jpg")             # or predict(chw floats), predict_rgb(pixels)
        model.class_names[prediction.top_classes(1)[0]], prediction.experts, prediction.timings["total"]

Results are the call's own: the library writes a prediction's answer into this call's buffers (mm_predict_f32_into,
mm_predict_rgb8_into), whichever threads share the Model. Failures raise LibraryError: LibraryUsageError (a
UsageError) for a bad argument or bundle, so a command prints one line and exits 2; LibraryRuntimeError (a
RuntimeError) for a runtime failure. `prepare` does a
bundle's first launch ahead. The library comes from `library_path()`: the one built for this host from the package's
sources (mobile_moe/library/build.py), or MOBILE_MOE_LIBRARY's.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mobile_moe.errors import RuntimeFailure, UsageError
from mobile_moe.library.options import OPTIONS, checked

MM_OK, MM_BAD_ARGUMENT, MM_BAD_BUNDLE, MM_RUNTIME_ERROR, MM_OUT_OF_MEMORY = range(5)
REQUIRED_VERSION = 20200  # MOBILE_MOE_VERSION 2.2.0: per-call results, mm_prepare, mm_default_weight_cache_dir
STATUS_NAMES = ("MM_OK", "MM_BAD_ARGUMENT", "MM_BAD_BUNDLE", "MM_RUNTIME_ERROR", "MM_OUT_OF_MEMORY")
_C_TYPES = {"int": ctypes.c_int, "float": ctypes.c_float, "path": ctypes.c_char_p}


class Options(ctypes.Structure):
    """mm_options: struct_size, then the options table's fields in its order (the table is the header's order)."""

    _fields_ = [("struct_size", ctypes.c_size_t), *((option.name, _C_TYPES[option.kind]) for option in OPTIONS)]


class StageTimes(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t),
                *((name, ctypes.c_double) for name in ("router_ms", "expert_ms", "load_ms", "tail_ms", "load_wait_ms",
                                                       "total_ms")),
                ("cache_hit", ctypes.c_int)]  # fmt: skip


class Result(ctypes.Structure):
    """mm_result: the caller's arrays in, one prediction's answer out."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("logits", ctypes.POINTER(ctypes.c_float)),
                ("logits_capacity", ctypes.c_size_t), ("classes", ctypes.POINTER(ctypes.c_int)),
                ("probabilities", ctypes.POINTER(ctypes.c_float)), ("top_k", ctypes.c_int),
                ("experts", ctypes.POINTER(ctypes.c_int)), ("gates", ctypes.POINTER(ctypes.c_float)),
                ("experts_capacity", ctypes.c_int), ("num_classes", ctypes.c_int), ("num_top", ctypes.c_int),
                ("num_experts", ctypes.c_int),
                *((name, ctypes.c_double) for name in ("router_ms", "expert_ms", "load_ms", "tail_ms", "load_wait_ms",
                                                       "total_ms")),
                ("cache_hit", ctypes.c_int)]  # fmt: skip


class LoadSettings(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("read_files", ctypes.c_int), ("workspace_sharing", ctypes.c_int),
                ("kept_loads", ctypes.c_int)]  # fmt: skip


class ModelInfo(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("bundle_dir", ctypes.c_char_p), ("kind", ctypes.c_int),
                ("kind_name", ctypes.c_char_p), ("layout", ctypes.c_char_p), ("weight_cache_dir", ctypes.c_char_p),
                *((name, ctypes.c_int) for name in ("threads", "num_experts", "top_k", "cache_experts", "prefetch",
                                                     "has_trunk_tail", "graphs")),
                ("resident_load_ms", ctypes.c_double), ("weight_cache_off", ctypes.c_char_p)]  # fmt: skip


class LoadEvent(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("graph", ctypes.c_char_p), ("bytes", ctypes.c_int64),
                *((name, ctypes.c_double) for name in ("ms", "program_ms", "data_map_ms", "cache_check_ms",
                                                        "method_ms", "cache_record_ms", "bring_in_ms")),
                ("cache", ctypes.c_char_p), ("weights", ctypes.c_char_p)]  # fmt: skip


LOG_LEVELS = ("debug", "info", "error")  # mm_log_level's values, in order
_LogCallback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_ProgressCallback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
_float_p, _int_p = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int)
_uint8_p = ctypes.POINTER(ctypes.c_uint8)
_handle = ctypes.c_void_p
# Every function this binding calls, as the headers declare it: name -> (restype, argtypes).
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "mm_version": (ctypes.c_char_p, []),
    "mm_version_number": (ctypes.c_int, []),
    "mm_options_init": (None, [ctypes.POINTER(Options), ctypes.c_size_t]),
    "mm_last_error": (ctypes.c_char_p, []),
    "mm_log_set": (None, [ctypes.c_void_p, ctypes.c_void_p]),
    "mm_default_weight_cache_dir": (ctypes.c_char_p, []),
    "mm_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(Options), ctypes.POINTER(_handle)]),
    "mm_close": (None, [_handle]),
    "mm_prepare": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(Options), _ProgressCallback, ctypes.c_void_p]),
    "mm_num_classes": (ctypes.c_int, [_handle]),
    "mm_class_name": (ctypes.c_char_p, [_handle, ctypes.c_int]),
    "mm_input_channels": (ctypes.c_int, [_handle]),
    "mm_input_size": (ctypes.c_int, [_handle]),
    "mm_predict_f32": (ctypes.c_int, [_handle, _float_p, ctypes.c_size_t]),
    "mm_predict_rgb8": (ctypes.c_int, [_handle, _uint8_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int]),
    "mm_preprocess_rgb8": (ctypes.c_int, [_handle, _uint8_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                          ctypes.c_int, _float_p, ctypes.c_size_t]),
    "mm_predict_f32_into": (ctypes.c_int, [_handle, _float_p, ctypes.c_size_t, ctypes.POINTER(Result)]),
    "mm_predict_rgb8_into": (ctypes.c_int, [_handle, _uint8_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                            ctypes.c_int, ctypes.POINTER(Result)]),
    "mm_result_init": (None, [ctypes.POINTER(Result), ctypes.c_size_t]),
    "mm_logits": (ctypes.c_size_t, [_handle, _float_p, ctypes.c_size_t]),
    "mm_top_classes": (ctypes.c_int, [_handle, ctypes.c_int, _int_p, _float_p]),
    "mm_experts": (ctypes.c_int, [_handle, ctypes.c_int, _int_p, _float_p]),
    "mm_stage_times_get": (None, [_handle, ctypes.POINTER(StageTimes), ctypes.c_size_t]),
    # mobile_moe_measure.h
    "mm_load_settings_init": (None, [ctypes.POINTER(LoadSettings), ctypes.c_size_t]),
    "mm_open_with": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(Options), ctypes.POINTER(LoadSettings),
                                    ctypes.POINTER(_handle)]),
    "mm_model_info_get": (ctypes.c_int, [_handle, ctypes.POINTER(ModelInfo), ctypes.c_size_t]),
    "mm_load_count": (ctypes.c_int64, [_handle]),
    "mm_load_event_get": (ctypes.c_int, [_handle, ctypes.c_int64, ctypes.POINTER(LoadEvent), ctypes.c_size_t]),
    "mm_loaded_graphs": (ctypes.c_int, [_handle, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]),
    "mm_parked_experts": (ctypes.c_int, [_handle, ctypes.c_int, _int_p]),
    "mm_expert_unload": (ctypes.c_int, [_handle, ctypes.c_int]),
    "mm_expert_load": (ctypes.c_int, [_handle, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]),
    "mm_expert_run": (ctypes.c_int, [_handle, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]),
    "mm_route_f32": (ctypes.c_int, [_handle, _float_p, ctypes.c_size_t]),
}



class LibraryError(Exception):
    """A call the library refused or failed: `status` (MM_BAD_ARGUMENT, ...) and its one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class LibraryUsageError(LibraryError, UsageError):
    """MM_BAD_ARGUMENT or MM_BAD_BUNDLE: bad input, which a command prints in one line and exits 2 for."""


class LibraryRuntimeError(LibraryError, RuntimeFailure):
    """MM_RUNTIME_ERROR or MM_OUT_OF_MEMORY: the library could not do what it was rightly asked."""


def library_path() -> Path:
    """MOBILE_MOE_LIBRARY (a libmobile_moe.so an app ships, or another build), else the one built for this host from
    the package's sources, building it first where needed: a UsageError with the fix where it cannot be."""
    given = os.environ.get("MOBILE_MOE_LIBRARY")
    if given:
        if not os.path.isfile(given):
            raise UsageError(f"MOBILE_MOE_LIBRARY={given}: no such file; point it at a libmobile_moe.so, or unset it")
        return Path(given)
    from mobile_moe.library.build import build_library

    return build_library()


class Library:
    """The loaded libmobile_moe, its functions typed (`library.mm_open(...)`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.cdll = ctypes.CDLL(str(self.path))
        except OSError as error:
            raise UsageError(f"cannot load libmobile_moe from {self.path}: {error}") from None
        version = self.cdll.mm_version_number() if hasattr(self.cdll, "mm_version_number") else 0
        if version < REQUIRED_VERSION:
            raise UsageError(f"{self.path} is libmobile_moe {version // 10000}.{version // 100 % 100}; this toolkit "
                             f"needs {REQUIRED_VERSION // 10000}.{REQUIRED_VERSION // 100 % 100} or later: unset "
                             "MOBILE_MOE_LIBRARY, or point it at a newer build")  # fmt: skip
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(self.cdll, name)
            function.restype, function.argtypes = restype, argtypes
        # Every log callback ever set, kept alive: the library calls a callback outside its lock, so one replaced may
        # still run on another thread for a moment after mm_log_set returns.
        self._log_callbacks: list[Any] = []

    def __getattr__(self, name: str):
        if name.startswith("mm_"):
            return getattr(self.cdll, name)
        raise AttributeError(name)

    def last_error(self) -> str:
        return self.mm_last_error().decode("utf-8", "replace")

    def check(self, status: int) -> None:
        """Nothing for MM_OK; else the call's failure, raised with this thread's message."""
        if status == MM_OK:
            return
        kind = LibraryRuntimeError if status in (MM_RUNTIME_ERROR, MM_OUT_OF_MEMORY) else LibraryUsageError
        raise kind(status, self.last_error())

    def version(self) -> str:
        return self.mm_version().decode()

    def default_weight_cache_dir(self) -> str:
        """The packed-weight folder the defaults use in this environment (the library's rule); "" where none can
        be made."""
        return self.mm_default_weight_cache_dir().decode("utf-8", "surrogateescape")

    def set_log(self, callback) -> None:
        """`callback(level, message)` (level: "debug", "info" or "error") gets the library's and ExecuTorch's log,
        for the whole process, from any thread; None drops it (the default)."""
        if callback is None:
            self.mm_log_set(None, None)
            return

        def forward(level: int, message: bytes, _user: int) -> None:
            name = LOG_LEVELS[level] if 0 <= level < len(LOG_LEVELS) else str(level)
            callback(name, message.decode("utf-8", "replace"))

        wrapped = _LogCallback(forward)
        self._log_callbacks.append(wrapped)
        self.mm_log_set(ctypes.cast(wrapped, ctypes.c_void_p), None)

    def prepare(self, bundle: str | os.PathLike, progress=None, **options: Any) -> None:
        """mm_prepare: the bundle's first-launch work done now (checked, every graph packed into the packed-weight
        folder of `options`), so a later open and first prediction cost a second launch's; `progress(done, total)`
        after each graph."""
        report = _ProgressCallback((lambda done, total, _user: progress(done, total)) if progress else 0)
        status = self.mm_prepare(os.fsencode(os.fspath(bundle)), ctypes.byref(self.options(options)), report, None)
        self.check(status)

    def options(self, values: dict[str, Any]) -> Options:
        """mm_options: mm_default_options', with `values` (option name -> value, checked against the table) over
        them."""
        options = Options()
        self.mm_options_init(ctypes.byref(options), ctypes.sizeof(Options))
        for name, value in checked(dict(values), flags=False).items():
            setattr(options, name, os.fsencode(value) if isinstance(value, str) else value)
        return options


_loaded: dict[Path | None, Library] = {}  # None: the default library
_loading = threading.Lock()


def default_weight_cache_dir() -> Path | None:
    """The packed-weight folder libmobile_moe's defaults use in this process's environment (the library's rule,
    MOBILE_MOE_WEIGHT_CACHE among it), made if missing; None where none can be used (the library logs why)."""
    folder = load_library().default_weight_cache_dir()
    return Path(folder) if folder else None


def load_library(path: str | os.PathLike | None = None) -> Library:
    """The library at `path`, loaded once per process; None: library_path()'s, found (or built) once per process."""
    with _loading:
        if path is None and None in _loaded:
            return _loaded[None]
        resolved = Path(path) if path is not None else library_path()
        if resolved not in _loaded:
            _loaded[resolved] = Library(resolved)
        if path is None:
            _loaded[None] = _loaded[resolved]
        return _loaded[resolved]


@dataclass(frozen=True)
class Prediction:
    """One image's answer: every logit, the experts it took (highest gate first; the experts used, ascending, for a
    whole bundle; none for a dense one) and their gates, and the library's stage times in ms (router, load, experts,
    tail, load_wait, total) with whether every chosen expert was loaded already."""

    logits: np.ndarray
    experts: list[int]
    gates: list[float]
    timings: dict[str, float] = field(default_factory=dict)
    cache_hit: bool = True

    def probabilities(self) -> np.ndarray:
        """Softmax of the logits, in double (as mm_top_classes computes it)."""
        values = self.logits.astype(np.float64)
        exp = np.exp(values - values.max())
        return exp / exp.sum()

    def top_classes(self, k: int) -> list[int]:
        """The k most probable classes, most probable first; ties: the lower index first (mm_top_classes' order)."""
        return [int(i) for i in np.argsort(-self.probabilities(), kind="stable")[:k]]


class Model:
    """One open bundle (an mm_model handle). `options`: libmobile_moe's, by name (options.py); those left out keep
    mm_default_options'. `load_settings`: mobile_moe_measure.h's (read_files, workspace_sharing, kept_loads), for
    measuring clients."""

    def __init__(self, bundle: str | os.PathLike, *, library: Library | None = None,
                 load_settings: dict[str, int] | None = None, **options: Any):  # fmt: skip
        self.library = library or load_library()
        self.bundle = Path(bundle)
        self._lock = threading.Lock()
        handle = _handle()
        given = self.library.options(options)
        path = os.fsencode(os.fspath(bundle))
        if load_settings is None:
            self.library.check(self.library.mm_open(path, ctypes.byref(given), ctypes.byref(handle)))
        else:
            settings = LoadSettings()
            self.library.mm_load_settings_init(ctypes.byref(settings), ctypes.sizeof(LoadSettings))
            for name, value in load_settings.items():
                setattr(settings, name, value)
            status = self.library.mm_open_with(path, ctypes.byref(given), ctypes.byref(settings), ctypes.byref(handle))
            self.library.check(status)
        self.handle = handle
        self._closer = weakref.finalize(self, self.library.mm_close, handle)
        self.class_names = [self._class_name(i) for i in range(self.library.mm_num_classes(handle))]
        channels, size = self.library.mm_input_channels(handle), self.library.mm_input_size(handle)
        self.input_shape = (channels, size, size)
        self._max_experts = max(self.info["num_experts"], 1)  # the most an image can take (a whole bundle: every one)

    def _class_name(self, index: int) -> str:
        return self.library.mm_class_name(self.handle, index).decode("utf-8", "replace")

    def close(self) -> None:
        """Frees the handle (after a call running on it); later calls are refused. Closing twice does nothing."""
        with self._lock:
            self._closer()

    def _open_handle(self):
        """The handle, for a call made under the lock; refused once closed (its address may be another Model's by
        then: the library would take it for that one)."""
        if not self._closer.alive:
            raise LibraryUsageError(MM_BAD_ARGUMENT, f"the model of {self.bundle} is closed")
        return self.handle

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def info(self) -> dict[str, Any]:
        """mm_model_info: the bundle and the options as mm_open resolved them (strings decoded)."""
        info = ModelInfo()
        with self._lock:
            status = self.library.mm_model_info_get(self._open_handle(), ctypes.byref(info), ctypes.sizeof(info))
        self.library.check(status)
        return {name: _text(getattr(info, name)) for name, _ in ModelInfo._fields_[1:]}

    def loaded_expert_graphs(self) -> list[str]:
        """The graphs of the experts loaded now (mm_loaded_graphs), least recently used last."""
        with self._lock:
            handle = self._open_handle()
            count = self.library.mm_loaded_graphs(handle, 0, None)
            names = (ctypes.c_char_p * max(count, 1))()
            count = min(count, self.library.mm_loaded_graphs(handle, count, names))
        return [names[i].decode() for i in range(count)]

    def predict(self, image: Any) -> Prediction:
        """One image as the bundle takes it: float32 (C, S, S) or (1, C, S, S), resized and normalised (a numpy array
        or a torch tensor)."""
        values = _chw(image, self.input_shape)
        answer = _Answer(self.library, len(self.class_names), self._max_experts)
        with self._lock:  # against a close meanwhile, and a handle address reused after it
            status = self.library.mm_predict_f32_into(self._open_handle(), values.ctypes.data_as(_float_p), values.size,
                                                      ctypes.byref(answer.result))  # fmt: skip
        self.library.check(status)
        return answer.prediction()

    def predict_rgb(self, pixels: np.ndarray) -> Prediction:
        """One image as an app has it, 8-bit RGB (H, W, 3), resized and normalised by the library as the bundle's
        manifest says (mm_predict_rgb8)."""
        rgb = _rgb8(pixels)
        height, width, _ = rgb.shape
        pointer = rgb.ctypes.data_as(_uint8_p)
        answer = _Answer(self.library, len(self.class_names), self._max_experts)
        with self._lock:
            status = self.library.mm_predict_rgb8_into(self._open_handle(), pointer, rgb.nbytes, width, height,
                                                       3 * width, ctypes.byref(answer.result))  # fmt: skip
        self.library.check(status)
        return answer.prediction()

    def predict_file(self, path: str | os.PathLike) -> Prediction:
        """One image file (PNG, JPEG, ...), decoded as training read its images (mobile_moe/data/image_files.py:
        upright, 8-bit RGB), then predict_rgb."""
        return self.predict_rgb(read_rgb(path))

    def preprocess_rgb(self, pixels: np.ndarray) -> np.ndarray:
        """The (C, S, S) float32 values the library feeds the bundle for these pixels (mm_preprocess_rgb8)."""
        rgb = _rgb8(pixels)
        height, width, _ = rgb.shape
        out = np.zeros(int(np.prod(self.input_shape)), dtype=np.float32)
        with self._lock:
            pixels, values = rgb.ctypes.data_as(_uint8_p), out.ctypes.data_as(_float_p)
            status = self.library.mm_preprocess_rgb8(self._open_handle(), pixels, rgb.nbytes, width, height, 3 * width,
                                                     values, out.size)  # fmt: skip
            self.library.check(status)
        return out.reshape(self.input_shape)


class _Answer:
    """One call's mm_result and the arrays it points at, sized by the bundle (never by a caller's number)."""

    def __init__(self, library: Library, classes: int, experts: int):
        self.logits = np.zeros(classes, dtype=np.float32)
        self.experts = np.zeros(max(experts, 1), dtype=np.int32)
        self.gates = np.zeros(max(experts, 1), dtype=np.float32)
        self.result = result = Result()
        library.mm_result_init(ctypes.byref(result), ctypes.sizeof(Result))
        result.logits, result.logits_capacity = self.logits.ctypes.data_as(_float_p), classes
        result.experts, result.gates = self.experts.ctypes.data_as(_int_p), self.gates.ctypes.data_as(_float_p)
        result.experts_capacity = experts

    def prediction(self) -> Prediction:
        result, taken = self.result, min(self.result.num_experts, self.result.experts_capacity)
        timings = {"router": result.router_ms, "load": result.load_ms, "experts": result.expert_ms,
                   "tail": result.tail_ms, "load_wait": result.load_wait_ms, "total": result.total_ms}  # fmt: skip
        experts, gates = [int(e) for e in self.experts[:taken]], [float(g) for g in self.gates[:taken]]
        return Prediction(self.logits, experts, gates, timings, bool(result.cache_hit))


def read_rgb(path: str | os.PathLike) -> np.ndarray:
    """An image file as (H, W, 3) uint8 RGB, read by the toolkit's one decoder (an UnreadableImage line if it cannot
    be)."""
    from mobile_moe.data.image_files import read_image

    return np.asarray(read_image(path, "RGB"), dtype=np.uint8)


def _text(value: Any) -> Any:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def _chw(image: Any, shape: tuple[int, int, int]) -> np.ndarray:
    array = image.detach().cpu().numpy() if hasattr(image, "detach") else image
    if not isinstance(array, np.ndarray):
        raise UsageError(f"image must be a numpy array or torch tensor, got {type(image).__name__}")
    if array.dtype != np.float32:
        raise UsageError(f"image dtype {array.dtype}: the bundle takes float32 (normalised with its mean/std)")
    if array.shape not in (shape, (1, *shape)):
        raise UsageError(f"image shape {tuple(array.shape)}: the bundle takes {shape} or {(1, *shape)}")
    return np.ascontiguousarray(array).reshape(-1)


def _rgb8(pixels: Any) -> np.ndarray:
    array = np.asarray(pixels)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise UsageError(f"pixels of dtype {array.dtype} and shape {array.shape}: give (H, W, 3) uint8 RGB")
    return np.ascontiguousarray(array)
