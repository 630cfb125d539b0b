"""A live run's dashboard in a browser; read-only unless --control.

examples:
  dflash-tui serve runs/demo                     http://127.0.0.1:8000/, a view
  dflash-tui serve runs/demo --control           a and r reach the run; the URL carries a token
  dflash-tui serve runs/demo --port 9000         then from a laptop: ssh -L 9000:127.0.0.1:9000 HOST

Each browser tab runs its own `dflash-tui attach RUN_DIR` (with --control when serve has it),
so the training process is never duplicated. The rule for every view (attach, serve): it
watches and never acts on the run unless --control is given. Ctrl+C stops serving; the run goes
on.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

from ._shared import run_events


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflash_tui.browser.server import DEFAULT_HOST, DEFAULT_PORT

    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="the run folder (run.output_dir/run.name, e.g. runs/demo)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}: reach it with ssh -L)")
    p.add_argument("--control", action="store_true",
                   help="allow abort and restart from the browser; the URL then carries a "
                        "random token and requests without it get 403 (default: a view only)")


def run(args: argparse.Namespace) -> int:
    events = run_events(args.run_dir, "serve")
    if events is None:
        return 2
    from dflash_tui.browser.server import make_server

    run_dir = events.parent
    try:
        server = make_server(run_dir, args.host, args.port,
                             secrets.token_urlsafe(24) if args.control else None)
    except ImportError as exc:
        print(f"dflash-tui serve needs textual-serve: {exc}\nhint: pip install textual-serve",
              file=sys.stderr)
        return 2
    try:
        server.serve()
    except OSError as exc:
        print(f"cannot serve on {args.host}:{args.port}: {exc}\nhint: pick another --port",
              file=sys.stderr)
        return 1
    return 0
