"""What several verbs share: the check that a path is a run, and the step-count argument."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash_core.persist.run_path import NotARun, events_of


def run_events(path: Path, action: str, *, file_ok: bool = False) -> Path | None:
    """The events file of the run at ``path``; None (the reason and the fix printed) when it
    is not a run. ``action`` finishes "nothing to ...": "attach to", "replay", ..."""
    try:
        return events_of(path, file_ok=file_ok)
    except NotARun as exc:
        print(f"nothing to {action}: {exc}\nhint: {exc.hint}", file=sys.stderr)
        return None


def steps(text: str) -> int:
    """--max-steps: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = all epochs), got {value}")
    return value
