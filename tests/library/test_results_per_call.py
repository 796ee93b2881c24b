"""A prediction's answer belongs to the call (mm_predict_f32_into, mm_predict_rgb8_into): threads sharing one handle,
with no lock of their own, each get their own image's answer, every time. The C API is called raw through ctypes
(which lets go of the GIL), as two threads of a C app would call it."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
from conftest import bundle_images, needs_build

from mobile_moe.library.binding import MM_BAD_ARGUMENT, MM_OK, Library, Result

pytestmark = [pytest.mark.export, needs_build]


def result_for(library: Library, logits: np.ndarray, experts: np.ndarray, top: np.ndarray) -> Result:
    result = Result()
    library.mm_result_init(ctypes.byref(result), ctypes.sizeof(Result))
    result.logits, result.logits_capacity = logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), logits.size
    result.experts = experts.ctypes.data_as(ctypes.POINTER(ctypes.c_int))
    result.experts_capacity = experts.size
    result.classes, result.top_k = top.ctypes.data_as(ctypes.POINTER(ctypes.c_int)), top.size
    return result


def predict_into(library: Library, handle, image: np.ndarray) -> tuple[np.ndarray, list[int], list[int]]:
    logits, experts, top = np.zeros(7, np.float32), np.zeros(4, np.int32), np.zeros(3, np.int32)
    result = result_for(library, logits, experts, top)
    values = np.ascontiguousarray(image, dtype=np.float32).reshape(-1)
    pointer = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    assert library.mm_predict_f32_into(handle, pointer, values.size, ctypes.byref(result)) == MM_OK
    return logits, experts[: result.num_experts].tolist(), top[: result.num_top].tolist()


@pytest.fixture
def opened(bundle):
    from mobile_moe.library.binding import load_library

    library, handle = load_library(), ctypes.c_void_p()
    options = library.options({"cache_experts": 1, "park_experts": 0})  # every switch loads: long, racy calls
    assert library.mm_open(str(bundle).encode(), ctypes.byref(options), ctypes.byref(handle)) == MM_OK
    yield library, handle
    library.mm_close(handle)


def test_threads_sharing_a_handle_each_get_their_own_answer(opened):
    library, handle = opened
    images = bundle_images(8).numpy()
    alone = [predict_into(library, handle, image) for image in images]
    assert len({tuple(experts) for _, experts, _ in alone}) > 1, "precondition: the images take several experts"
    wrong = []

    def serve(first: int) -> None:
        for round_ in range(40):
            index = (first + 2 * round_) % len(images)  # thread 0 the even images, thread 1 the odd ones
            logits, experts, top = predict_into(library, handle, images[index])
            if not (np.array_equal(logits, alone[index][0]) and (experts, top) == alone[index][1:]):
                wrong.append(index)

    threads = [threading.Thread(target=serve, args=(first,)) for first in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_a_result_that_was_never_initialised_or_promises_room_without_an_array_is_refused(opened):
    library, handle = opened
    image = np.zeros(3 * 32 * 32, np.float32)
    pointer = image.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    garbage = Result()  # struct_size 0: never initialised
    assert library.mm_predict_f32_into(handle, pointer, image.size, ctypes.byref(garbage)) == MM_BAD_ARGUMENT
    assert "mm_default_result" in library.last_error()
    promising = Result()
    library.mm_result_init(ctypes.byref(promising), ctypes.sizeof(Result))
    promising.top_k = 5  # room for 5 classes, and no array
    assert library.mm_predict_f32_into(handle, pointer, image.size, ctypes.byref(promising)) == MM_BAD_ARGUMENT
    assert "no array to write them to" in library.last_error()
    asked_nothing = Result()
    library.mm_result_init(ctypes.byref(asked_nothing), ctypes.sizeof(Result))
    assert library.mm_predict_f32_into(handle, pointer, image.size, ctypes.byref(asked_nothing)) == MM_OK
    assert (asked_nothing.num_classes, asked_nothing.num_top) == (7, 0) and asked_nothing.total_ms > 0
