"""``dflash-tui report RUN_DIR``: one self-contained HTML page of a run, from its events.jsonl.

What operators look at after (or during) a run, on one page that opens anywhere without a network:
loss, tau (teacher-forced per step and exact at each evaluation), samples/s, queue depths, memory
per GPU against its plan, errors and stalls on a timeline, the latest acceptance histogram and the
resolved config. By job: ``data`` folds the run's events into what the page shows (in bounded
``series``), ``plots`` draws them (matplotlib, imported lazily on the Agg backend: the dashboard
never imports it), ``page`` lays out the HTML; this module writes the file and is the command.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dflash_core.observe import event_log

from .data import MAX_SERIES, RunData, read_run
from .page import render_html
from .series import DEFAULT_CAP, FirstLast, Series

__all__ = ["DEFAULT_CAP", "MAX_SERIES", "FirstLast", "RunData", "Series", "main", "read_run",
           "render_html", "write_report"]


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None,
                 cap: int = DEFAULT_CAP) -> Path:
    """Read the run's events.jsonl and write its report (default RUN_DIR/report.html)."""
    run_dir = Path(run_dir)
    events_path = event_log.events_path(run_dir)
    out = Path(out) if out is not None else events_path.parent / "report.html"
    page = render_html(read_run(events_path, cap), source=str(events_path))
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)  # a reader never sees half a page
    return out


def main(argv: list[str]) -> int:
    """``dflash-tui report RUN_DIR [--out FILE]``."""
    p = argparse.ArgumentParser(
        prog="dflash-tui report",
        description="Write one self-contained HTML report of a run (finished, failed or still "
                    "running) from its events.jsonl: plots, errors, stalls and its config.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="the run folder (run.output_dir/run.name, e.g. runs/demo)")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="where to write the page (default RUN_DIR/report.html)")
    args = p.parse_args(argv)
    run_dir = args.run_dir
    events_path = event_log.events_path(run_dir)
    if not events_path.is_file():
        print(f"nothing to report: {events_path} does not exist\nhint: pass the folder of a run "
              f"(run.output_dir/run.name, e.g. runs/demo)", file=sys.stderr)
        return 2
    try:
        out = write_report(run_dir, args.out)
    except OSError as exc:
        print(f"could not write the report: {exc}", file=sys.stderr)
        return 1
    print(f"report written to {out} ({out.stat().st_size / 1024:.0f} KiB)")
    return 0
