"""What a dead run left behind: if the last run in a run folder's events.jsonl has no RunEnded (the
process was killed, the node rebooted), summarise where it stopped so the operator starting the
dashboard again sees it at once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_core.observe import event_log
from dflash_core.observe import events as ev
from dflash_core.observe.event_log import EVENTS_FILE

from .. import fmt


@dataclass
class PostMortem:
    run_name: str
    started_ts: float
    last_ts: float
    last_event: str  # kind of the last event written
    last_state: str
    last_step: ev.StepMetrics | None
    total_steps: int
    errors: int
    last_error: ev.Error | None
    last_log: ev.Log | None

    def lines(self) -> list[str]:
        out = [f"previous run {self.run_name or '?'} (started {fmt.clock(self.started_ts)}) "
               f"ended without RunEnded: the process died or was killed",
               f"last event {self.last_event} at {fmt.clock(self.last_ts)}, "
               f"{fmt.duration(self.last_ts - self.started_ts)} into the run; "
               f"last state {self.last_state}"]
        if self.last_step is not None:
            s = self.last_step
            total = f"/{self.total_steps}" if self.total_steps else ""
            out.append(f"last step {s.step}{total} (epoch {s.epoch}), loss {s.loss:.4f}")
        else:
            out.append("no training step was completed")
        if self.last_error is not None:
            e = self.last_error
            out.append(f"{self.errors} error(s); last: [{e.error_kind}] {e.source}: {e.message}")
            if e.hint:
                out.append(f"hint: {e.hint}")
        elif self.last_log is not None:
            out.append(f"last log line: {self.last_log.source}: {self.last_log.message}")
        return out


def last_run(events: list[ev.Event]) -> list[ev.Event]:
    """The events from the last RunStarted on (all of them if there is none)."""
    for i in range(len(events) - 1, -1, -1):
        if isinstance(events[i], ev.RunStarted):
            return events[i:]
    return events


def summarise(events: list[ev.Event]) -> PostMortem | None:
    """A post-mortem of the last run, or None when it ended properly (or nothing was written)."""
    run = last_run(events)
    if not run or any(isinstance(e, ev.RunEnded) for e in run):
        return None
    start = run[0]
    state, step, error, log, errors = "idle", None, None, None, 0
    for e in run:
        if isinstance(e, ev.StateChanged):
            state = e.state
        elif isinstance(e, ev.StepMetrics):
            step = e
        elif isinstance(e, ev.Error):
            error, errors = e, errors + 1
        elif isinstance(e, ev.Log):
            log = e
    return PostMortem(
        run_name=getattr(start, "run_name", ""), started_ts=start.ts, last_ts=run[-1].ts,
        last_event=run[-1].kind, last_state=state, last_step=step,
        total_steps=getattr(start, "total_steps", 0), errors=errors, last_error=error, last_log=log,
    )


def load(run_dir: str | Path) -> PostMortem | None:
    """Post-mortem of `run_dir` (a run folder, or an events.jsonl file itself)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / EVENTS_FILE
    if not path.is_file():
        return None
    return summarise(list(event_log.read_last_run(path)))  # the earlier runs are not read
