"""What several verbs share: the check that a path is a run, and argument types."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable

from dflash_core.persist.run_path import NotARun, events_of


def run_events(path: Path, action: str, *, file_ok: bool = False) -> Path | None:
    """The events file of the run at ``path``; None (the reason and the fix printed) when it
    is not a run. ``action`` finishes "nothing to ...": "attach to", "replay", ..."""
    try:
        return events_of(path, file_ok=file_ok)
    except NotARun as exc:
        print(f"nothing to {action}: {exc}\nhint: {exc.hint}", file=sys.stderr)
        return None


def whole_number(minimum: int, unit: str = "", zero: str = "",
                 maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``minimum`` (and <= ``maximum``; ``unit`` names what
    it counts, ``zero`` what 0 means, for the messages)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            of = f" of {unit}" if unit else ""
            raise argparse.ArgumentTypeError(f"expected a whole number{of}, got {text!r}")
        if value < minimum:
            means = f" ({zero})" if zero else ""
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{means}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    return parse


def real_number(minimum: float, *, strict: bool = False, unit: str = "") -> Callable[[str], float]:
    """An argparse type: a finite number >= ``minimum`` (> with ``strict``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            of = f" of {unit}" if unit else ""
            raise argparse.ArgumentTypeError(f"expected a number{of}, got {text!r}")
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if strict else '>='} {minimum:g}, got {value:g}")
        return value

    return parse


# --max-steps of run and demo
steps = whole_number(0, "steps", "0 = all epochs")


def setting(text: str) -> tuple[str, str]:
    """--set SECTION.KEY=VALUE: the key and the value's text (read as YAML by the config)."""
    key, eq, value = text.partition("=")
    if not eq or "." not in key.strip():
        raise argparse.ArgumentTypeError(
            f"expected SECTION.KEY=VALUE (e.g. optim.name=muon), got {text!r}")
    return key.strip(), value
