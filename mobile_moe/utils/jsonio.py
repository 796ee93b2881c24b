"""JSON that every reader accepts: no NaN or Infinity (Python's json writes them by default; JSON has no such
values). A non-finite float becomes null, so a broken number reads as "no value" instead of breaking the parser."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every non-finite float (nested in dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """json.dumps of `finite(value)`, refusing (ValueError) anything that would still not be valid JSON."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
