"""What the report shows of a run: its last run's events folded into bounded series, tables and
the latest values (``RunData``), read in one streaming pass (``read_run``).

Only the file's last run is read (a file may hold several, each beginning with RunStarted); it is
found by reading backwards (``event_log.last_run_offset``) and then streamed line by line, so a
multi-day events.jsonl is never held in memory. An unreadable line (a torn last line of a running
or killed run) is counted and skipped.
"""

from __future__ import annotations

import os

from dflash_core.observe import event_log
from dflash_core.observe import events as ev
from dflash_core.observe.fold import EventFold
from dflash_core.units import GiB as GIB

from .hours import HoursData
from .series import DEFAULT_CAP, FirstLast, Series
from .sets import SetSeries

MAX_SERIES = 64  # queues or GPUs with their own series; more names than this are counted only


class RunData(EventFold):
    """What the report shows of one run, fed one event at a time (``feed``); bounded in memory
    whatever the number of events."""

    def __init__(self, cap: int = DEFAULT_CAP) -> None:
        self.cap = cap
        self.started: ev.RunStarted | None = None
        self.t0: float | None = None
        self.last_ts: float | None = None
        self.state = "unknown"
        self.ended: ev.RunEnded | None = None
        self.end_reason = ""  # of the state change that ended the run
        self.states = FirstLast(100, 100)  # StateChanged
        self.loss = Series(cap)
        self.tau_tf = Series(cap)
        self.samples_per_s = Series(cap)
        self.step_at = Series(cap, mean=False)  # x: time, y: step (the plots' step axis)
        self.last_step: ev.StepMetrics | None = None
        self.evals = FirstLast(cap // 2, cap // 2)  # (ts, step, tau, prompts)
        self.last_eval: ev.EvalResult | None = None  # the latest held-out evaluation
        self.sets = SetSeries(cap)  # each prompt set's evaluations (eval.prompt_sets)
        self.hours = HoursData(cap)  # device time: to the best checkpoint, the end; tau on it
        self.queues: dict[str, Series] = {}
        self.queue_capacity: dict[str, int] = {}
        self.gpus: dict[int, dict] = {}  # index -> {"used", "alloc": Series, "name", ...}
        self.plan: ev.MemoryPlan | None = None
        self.checkpoints = FirstLast(5, 20)
        self.errors = FirstLast(50, 450)
        self.stalls = FirstLast(50, 450)  # [Stall, cleared_ts or None]
        self._open_stalls: dict[str, list] = {}  # worker -> its latest uncleared stall entry
        self.events = 0  # events read of this run
        self.unreadable = 0  # lines that did not parse (a torn last line, a damaged one)
        self.extra_names = 0  # samples of queues / GPUs past MAX_SERIES, not plotted

    # -- reading --------------------------------------------------------------------------------
    def feed(self, e: ev.Event) -> None:
        if isinstance(e, ev.RunStarted):
            self.__init__(self.cap)  # a later run in the same file starts the page over
        if self.t0 is None:
            self.t0 = e.ts
        self.events += 1
        self.last_ts = e.ts if self.last_ts is None else max(self.last_ts, e.ts)
        self.state = ev.state_after(self.state, e)
        self.dispatch(e)

    def count_unreadable(self, line: str) -> None:
        self.unreadable += 1

    def _on_RunStarted(self, e: ev.RunStarted) -> None:
        self.started, self.t0 = e, e.ts

    def _on_StateChanged(self, e: ev.StateChanged) -> None:
        self.states.add(e)
        if e.state in ev.TERMINAL_STATES:
            self.end_reason = e.reason

    def _on_RunEnded(self, e: ev.RunEnded) -> None:
        self.ended = e

    def _on_StepMetrics(self, e: ev.StepMetrics) -> None:
        self.loss.add(e.ts, e.loss)
        self.tau_tf.add(e.ts, e.tau_tf)
        self.samples_per_s.add(e.ts, e.samples_per_s)
        self.step_at.add(e.ts, e.step)
        self.last_step = e

    def _on_DeviceHours(self, e: ev.DeviceHours) -> None:
        self.hours.hours(e)

    def _on_EvalResult(self, e: ev.EvalResult) -> None:
        self.hours.evaluated(e)
        if e.prompt_set:  # a prompt set's: its own series, not the held-out's
            self.sets.add(e)
            return
        self.evals.add((e.ts, e.step, e.tau, e.prompts))
        self.last_eval = e

    def _named(self, table: dict, name, make):
        """``table[name]``, made on first sight while the table holds fewer than MAX_SERIES;
        None (counted in extra_names) past that."""
        got = table.get(name)
        if got is None:
            if len(table) >= MAX_SERIES:
                self.extra_names += 1
                return None
            got = table[name] = make()
        return got

    def _on_QueueDepth(self, e: ev.QueueDepth) -> None:
        series = self._named(self.queues, e.name, lambda: Series(self.cap))
        if series is None:
            return
        series.add(e.ts, e.depth)
        self.queue_capacity[e.name] = e.capacity

    def _on_GpuSample(self, e: ev.GpuSample) -> None:
        gpu = self._named(self.gpus, e.index,
                          lambda: {"used": Series(self.cap), "alloc": Series(self.cap)})
        if gpu is None:
            return
        gpu["used"].add(e.ts, e.mem_used / GIB)
        gpu["alloc"].add(e.ts, e.torch_allocated / GIB)
        gpu.update(name=e.name, total=e.mem_total / GIB, limit=e.limit / GIB, role=e.role,
                   retries=e.alloc_retries, ooms=e.ooms)

    def _on_MemoryPlan(self, e: ev.MemoryPlan) -> None:
        self.plan = e

    def _on_Checkpoint(self, e: ev.Checkpoint) -> None:
        self.hours.checkpoint(e)
        self.checkpoints.add(e)

    def _on_Error(self, e: ev.Error) -> None:
        self.errors.add(e)

    def _on_Stall(self, e: ev.Stall) -> None:
        if e.cleared:
            entry = self._open_stalls.pop(e.worker, None)
            if entry is not None:
                entry[1] = e.ts
            return
        entry = [e, None]
        self._open_stalls[e.worker] = entry
        self.stalls.add(entry)

    # -- derived --------------------------------------------------------------------------------
    @property
    def run_name(self) -> str:
        return self.started.run_name if self.started else "(no RunStarted in the file)"

    @property
    def total_steps(self) -> int:
        """The run's planned steps (0 = not known): the latest step's, else its RunStarted's."""
        last, s = self.last_step, self.started
        return last.total_steps if last and last.total_steps else (s.total_steps if s else 0)

    @property
    def over(self) -> bool:
        """The run has ended (finished, failed or aborted)."""
        return self.state in ev.TERMINAL_STATES

    def status(self) -> str:
        if self.state in ev.TERMINAL_STATES:
            return self.state
        return f"{self.state} (no end recorded: still running, or killed)"


def read_run(path: str | os.PathLike, cap: int = DEFAULT_CAP) -> RunData:
    """The last run of an events.jsonl (a run folder or the file itself), streamed: memory stays
    bounded by ``cap`` whatever the file's size. Only the kinds ``RunData`` handles are parsed
    (host samples, worker phases and logs are not on the page). Lines appended while it reads
    are left out."""
    data = RunData(cap)
    for event in event_log.read_last_run(path, kinds=RunData.kinds(),
                                         on_unreadable=data.count_unreadable):
        data.feed(event)
    return data
