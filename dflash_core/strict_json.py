"""JSON that every reader accepts: Python writes float('nan') and float('inf') as NaN and
Infinity, which are not JSON (jq, browsers and most libraries refuse the file). A non-finite number
in a file the run writes is a measurement that failed, so it is written as null."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (at any depth of dicts, lists and tuples) as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """json.dumps of ``finite(obj)``; refuses (ValueError) rather than write NaN or Infinity."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
