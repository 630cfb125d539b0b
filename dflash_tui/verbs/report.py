"""Write a run's report: one HTML page of plots, errors and config.

One self-contained file (no network needed to open it): plots, errors, stalls, the config.

examples:
  dflash-tui report runs/demo                     writes runs/demo/report.html
  dflash-tui report runs/demo --out /tmp/r.html
  dflash-tui report runs/demo/events.jsonl

Works on a finished, failed or still running run (what its events.jsonl holds so far).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._shared import run_events


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="the run folder (run.output_dir/run.name, e.g. runs/demo), or its "
                        "events.jsonl")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="where to write the page (default RUN_DIR/report.html)")


def run(args: argparse.Namespace) -> int:
    if run_events(args.run_dir, "report", file_ok=True) is None:
        return 2
    from dflash_tui.report import write_report

    try:
        out = write_report(args.run_dir, args.out)
    except OSError as exc:
        print(f"could not write the report: {exc}", file=sys.stderr)
        return 1
    print(f"report written to {out} ({out.stat().st_size / 1024:.0f} KiB)")
    return 0
