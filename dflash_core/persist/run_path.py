"""Where the events of a run are, given the path a command was handed (attach, serve, replay,
report): a run folder, or for the commands that read a recording, the events.jsonl itself.

A path that is not a run is refused with what it is and what to pass instead (`NotARun`):
missing, a file where a folder is wanted, a folder of several nodes' records (events in
``node-K/``), a folder that holds runs (``runs/``), or a folder with no events at all.
"""

from __future__ import annotations

from pathlib import Path

from dflash_core.observe.event_log import EVENTS_FILE as EVENTS

EXAMPLE = "run.output_dir/run.name, e.g. runs/demo"


class NotARun(Exception):
    """``path`` is not a run: ``str(exc)`` says why, ``hint`` what to pass."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


def events_of(path: str | Path, *, file_ok: bool = False) -> Path:
    """The events.jsonl of the run at ``path`` (a run folder; with ``file_ok`` also an events
    file itself). Raises NotARun naming the cause and the fix."""
    path = Path(path)
    events = path / EVENTS
    if path.is_file():
        if file_ok and path.suffix == ".jsonl":
            return path
        if file_ok and path.name != EVENTS:  # a binary, a config: not read, not written beside
            raise NotARun(f"{path} is a file, not a run's events (.jsonl) nor a run folder",
                          hint=f"pass the run folder ({EXAMPLE}) or its {EVENTS}")
        if path.name == EVENTS:  # the run's own events file: its folder is the run
            return path
        raise NotARun(f"{path} is a file, not a run folder",
                      hint=f"pass the folder that holds {EVENTS} ({EXAMPLE})")
    if not path.exists():
        if file_ok:
            raise NotARun(f"{path} does not exist",
                          hint=f"pass the run folder ({EXAMPLE}) or its {EVENTS}")
        raise NotARun(f"{events} does not exist (there is no {path})",
                      hint=f"pass the run folder ({EXAMPLE})")
    if not path.is_dir():
        raise NotARun(f"{path} is neither a file nor a folder",
                      hint=f"pass the run folder ({EXAMPLE})")
    if events.is_file():
        return events
    nodes = sorted(p.parent for p in path.glob(f"node-*/{EVENTS}"))
    if nodes:
        shown = ", ".join(str(p) for p in nodes[:4])
        raise NotARun(f"{events} does not exist: {path} is a run of several nodes, each with "
                      f"its own events", hint=f"pass one node's folder: {shown}")
    runs = sorted(p.parent for p in path.glob(f"*/{EVENTS}"))
    runs += sorted(p.parent.parent for p in path.glob(f"*/node-0/{EVENTS}"))
    if runs:
        shown = ", ".join(str(p) for p in sorted(set(runs))[:4])
        raise NotARun(f"{events} does not exist: {path} holds runs, it is not one",
                      hint=f"pass one of them: {shown}")
    raise NotARun(f"{events} does not exist",
                  hint=f"pass the run folder ({EXAMPLE})")
