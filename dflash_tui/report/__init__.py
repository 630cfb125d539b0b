"""``dflash-tui report RUN_DIR``: one self-contained HTML page of a run, from its events.jsonl.

What operators look at after (or during) a run, on one page that opens anywhere without a network:
loss, tau (teacher-forced per step and exact at each evaluation), samples/s, queue depths, memory
per GPU against its plan, errors and stalls on a timeline, the latest acceptance histogram and the
resolved config. By job: ``data`` folds the run's events into what the page shows (in bounded
``series``), ``plots`` draws them (matplotlib, imported lazily on the Agg backend: the dashboard
never imports it), ``page`` lays out the HTML; this module writes the file (its command:
``dflash_tui/verbs/report.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from dflash_core.observe import event_log

from .data import MAX_SERIES, RunData, read_run
from .page import render_html
from .series import DEFAULT_CAP, FirstLast, Series

__all__ = ["DEFAULT_CAP", "MAX_SERIES", "FirstLast", "RunData", "Series", "read_run",
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
