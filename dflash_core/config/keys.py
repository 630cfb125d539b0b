"""How a config key is declared: ``key`` puts its default, what it does and its valid range on
the dataclass field, where schema.py's sections, docs/config.md and ``--set``'s help read them."""

from __future__ import annotations

import copy
from dataclasses import field
from typing import Any

# A numeric key's valid range: (low, high, low included, high included); None = unbounded.
Range = tuple[float | None, float | None, bool, bool]


def key(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None,
        le: float | None = None, lt: float | None = None, unbounded: str = "") -> Any:
    """A config key: its default, what it does (``doc``) and, for a number, its valid range
    (``ge``/``gt`` the low end included/excluded, ``le``/``lt`` the high end). A number with no
    range says why in ``unbounded`` ("any integer"), so no key is left unchecked by oversight."""
    lo, lo_in = (ge, True) if ge is not None else (gt, False)
    hi, hi_in = (le, True) if le is not None else (lt, False)
    meta = {"doc": " ".join(doc.split()),
            "range": (lo, hi, lo_in, hi_in) if lo is not None or hi is not None else None,
            "unbounded": unbounded}
    if isinstance(default, (list, dict)):  # each config its own copy
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)
