"""Replay a recorded run (its events.jsonl or run folder).

examples:
  dflash-tui replay runs/demo                  the run folder: its events.jsonl
  dflash-tui replay runs/demo/events.jsonl     any events file of a run

The replay shows the whole recording at once, then how the run ended; a and r act on the
replay only, never on a run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._shared import run_events


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("events", type=Path, metavar="EVENTS_OR_RUN_DIR",
                   help="an events.jsonl, or the run folder that holds one")


def run(args: argparse.Namespace) -> int:
    path = run_events(args.events, "replay", file_ok=True)
    if path is None:
        return 2
    from dflash_tui.sources.replay import ReplayController

    try:
        controller = ReplayController.from_jsonl(path)
    except (OSError, UnicodeDecodeError) as exc:
        print(f"nothing to replay: cannot read {path}: {exc}\nhint: pass a run's events.jsonl "
              "(or its run folder)", file=sys.stderr)
        return 2
    if not controller.events:
        print(f"nothing to replay: {path} holds no events of a run\nhint: pass a run's "
              "events.jsonl (or its run folder, e.g. runs/demo)", file=sys.stderr)
        return 2
    from dflash_tui.app import run_app

    # No post-mortem: the replay itself shows how that run ended.
    return run_app(controller, run_dir=None)
