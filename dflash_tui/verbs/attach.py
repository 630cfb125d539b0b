"""Follow a run another process owns; read-only unless --control.

examples:
  dflash-tui attach runs/demo                a view: a (abort) and r (restart) are refused
  dflash-tui attach runs/demo --control      a and r reach the run
  dflash-tui attach runs/NAME/node-0         one node of a run on several nodes

The rule for every view (attach, serve): it watches and never acts on the run unless --control
is given. q detaches and leaves the run going; s (stacks) works either way. The old spelling
`dflash-tui --attach RUN_DIR` still controls the run as it always did (it means
`attach RUN_DIR --control`); `--attach RUN_DIR --read-only` is the view.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ._shared import run_events


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="the run folder (run.output_dir/run.name, e.g. runs/demo)")
    add_control(p, "abort and restart from this dashboard reach the run")


def add_control(p: argparse.ArgumentParser, what: str) -> None:
    """--control, and --read-only (the default, said explicitly): one rule for every view."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--control", action="store_true", help=f"{what} (default: a view only)")
    g.add_argument("--read-only", action="store_true",
                   help="a view: abort and restart are refused (the default)")


def run(args: argparse.Namespace) -> int:
    events = run_events(args.run_dir, "attach to")
    if events is None:
        return 2
    from dflash_tui.browser import lifeline

    # A browser's dashboard (serve): ends with its session or server, whatever its loop does.
    # Armed before the app's imports: threads a library starts while importing (numpy's BLAS
    # pool) must inherit the blocked signals, or a SIGTERM lands on one of them and waits for a
    # main thread stuck in a write.
    guard = lifeline.Lifeline().arm() if lifeline.served() else None
    from dflash_tui.app import run_app
    from dflash_tui.sources.follow import FollowController

    return run_app(FollowController(events.parent), run_dir=None, read_only=not args.control,
                   lifeline=guard)
