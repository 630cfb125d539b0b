"""What the dashboard shows, as plain data: events fold into it, panels read from it.

No Textual here, so every rule of the screen (roles of GPUs, a target's load -> warmup -> running,
which side is the bottleneck, elapsed and ETA) is testable by feeding a list of events.

Time is event time: "now" is the timestamp of the newest event seen. A replayed post-mortem then
shows the elapsed time of that run rather than the time since it died, and snapshots are stable.
Between events a live run's clock is moved on by `tick(wall_time)`, but only while the stream is
current (its newest event is seconds old): a replay of an old file never jumps to today.

The rows the panels draw (GpuRow, TargetRow, ...) are in rows.py; what the panels compute
from these facts without changing them (ETA, bottleneck, GPU rows with roles, tau gap) is in
views.py, DashboardState's base. Here: the facts and the handlers that keep them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Iterable

from dflash_core.config import EvalConfig
from dflash_core import acceptance
from dflash_core.context_buckets import context_line
from dflash_core.observe import events as ev
from dflash_core.observe.errors import error_from_exception
from dflash_core.observe.fold import EventFold

from .. import fmt
from .set_evals import SetEvals
from .rows import (TARGET_LOADED, TARGET_PENDING, ErrorEntry, GpuRow, LogLine, QueueRow,
                         TargetRow, device_index)
from .views import LIVE_STATES, DashboardViews

if TYPE_CHECKING:
    from ..sources.postmortem import PostMortem

# What a handler returns when every panel changed; the panels are listed in widgets/registry.py
# (above this: the state names a panel by its id, it does not know the list).
EVERY_PANEL = "*"
# A stream whose newest event is older than this is a replay (or a hung engine): its clock stays.
LIVE_CLOCK_S = 30.0
# The statuses of a target still at work: one that says nothing more once the run ends has stopped.
_TARGET_AT_WORK = (ev.WORKER_LOADING, TARGET_LOADED, ev.WORKER_WARMUP, ev.WORKER_RUNNING)
# A worker's last word (its WorkerStatus as its thread ends): one log line each.
_WORKER_ENDS = (ev.WORKER_DONE, ev.WORKER_STOPPED)


# A GPU with less than this share of its usable memory left (or whose allocator starts retrying)
# gets one warning in the log until it recovers.
TIGHT_HEADROOM = 0.03


def _queue_order(name: str) -> tuple:
    # prefetch-0, prefetch-1, ..., prefetch-10, then hs, then anything else by name
    rank = ev.prefetch_rank(name)
    if rank is not None:
        return (0, rank, name)
    return (1 if name == ev.HS_QUEUE else 2, 0, name)


class DashboardState(EventFold, DashboardViews):
    """The screen's facts, folded from events by ``_on_<Kind>`` handlers (``EventFold``)."""

    def __init__(self, *, log_lines: int = 1000, loss_points: int = 600) -> None:
        self.log: deque[LogLine] = deque(maxlen=log_lines)
        self.log_seq = 0
        self.errors: list[ErrorEntry] = []
        self.gpus: dict[int, GpuRow] = {}
        self.host: ev.HostSample | None = None
        self.sinks: dict[str, ev.SinkStatus] = {}
        self.state = "idle"
        self.reason = ""  # why the state last changed (shown beside a failed / aborted state)
        self.now = 0.0
        self._loss_points = loss_points
        self._reset_run()
        self.run_name = ""
        self.run_dir = ""
        self.attached = False  # following a run another process owns (dflash-tui --attach)
        self.read_only = False  # a view: abort and restart refused (dflash-tui serve)

    def _reset_run(self) -> None:
        """Per-run facts; a restart publishes a new RunStarted and these start again."""
        self.started_ts: float | None = None
        self.end_ts: float | None = None
        self.total_steps = 0
        self.plan: ev.TrainingPlan | None = None  # where training starts, what limit ends it
        # The step the run starts from: 0, a resume's checkpoint step (TrainingPlan), or None
        # while a resume has not said it yet; the run's last step once it ended (RunEnded).
        self.start_step: int | None = 0
        self.end_step: int | None = None
        self.ended_in = ""  # the state a run that ended was in when it ended (preflight, ...)
        self.checkpoint_writing: ev.CheckpointProgress | None = None  # written in the background
        self.building: ev.BuildProgress | None = None  # the demo's target or data, being made
        self.allocator = ""  # CUDA allocator settings of the run ("" on CPU)
        self.stalls: dict[str, ev.Stall] = {}  # workers stalled now (cleared by progress)
        # (step, exact tau, teacher-forced tau of the step then) of every evaluation
        self.eval_history: deque[tuple[int, float, float | None]] = deque(maxlen=500)
        self.best: ev.Checkpoint | None = None  # checkpoints/best: the highest exact tau
        self.hours: ev.DeviceHours | None = None  # the device time so far (hours.py)
        self.tau_gap_warn = EvalConfig.tau_gap_warn  # eval.tau_gap_warn of the run's config
        self.target_labels: list[str] = []
        self.drafter_labels: list[str] = []
        self.targets: dict[str, TargetRow] = {}
        self.workers: dict[str, ev.WorkerStatus] = {}  # each worker's latest WorkerStatus
        self.drafter_times: dict[str, ev.DrafterMetrics] = {}  # latest report per drafter
        self.queues: dict[str, QueueRow] = {}
        self.step: ev.StepMetrics | None = None
        self.eval: ev.EvalResult | None = None  # the latest held-out evaluation
        self.set_evals = SetEvals()  # the latest of each prompt set (eval.prompt_sets)
        self.loss_history: deque[float] = deque(maxlen=self._loss_points)
        self._step_window: deque[tuple[float, int]] = deque(maxlen=50)
        # Several nodes: each node's latest summary (empty on one node: no nodes panel).
        self.nodes: dict[int, ev.NodeStatus] = {}

    # ---------------------------------------------------------------- folding

    def apply_all(self, events: Iterable[ev.Event]) -> set[str]:
        changed: set[str] = set()
        for e in events:
            changed |= self.apply(e)
        return changed

    def apply(self, e: ev.Event) -> set[str]:
        """Fold one event; returns the names of the panels it changed."""
        self.now = max(self.now, e.ts)
        handler = self.handler(e)
        if handler is None:
            return set()
        try:
            return handler(e) | {"header"}
        except Exception as exc:  # a malformed event must not take the dashboard down
            return self.add_error(error_from_exception(
                exc, error_kind="internal", source="dashboard", fatal=False,
                hint=f"the dashboard could not show a {e.kind} event; the run is not affected"))

    def tick(self, wall: float) -> bool:
        """Advance a live run's clock to `wall`; True when the shown elapsed second changed."""
        if not self.live or not 0 < wall - self.now < LIVE_CLOCK_S:
            return False
        before = int(self.elapsed or 0)
        self.now = wall
        return int(self.elapsed or 0) != before

    def add_log(self, level: str, source: str, text: str, ts: float | None = None) -> None:
        self.log_seq += 1
        self.log.append(LogLine(self.log_seq, self.now if ts is None else ts, level, source, text))

    def add_error(self, e: ev.Error, previous: bool = False) -> set[str]:
        self.errors.append(ErrorEntry(e, previous))
        if not previous:
            self.add_log("error", e.source, f"[{e.error_kind}] {e.message}", e.ts)
        return {"errors", "header", "log"}

    def _on_RunStarted(self, e: ev.RunStarted) -> set[str]:
        self._reset_run()
        self.run_name, self.run_dir = e.run_name, e.run_dir
        self.started_ts = e.ts
        self.total_steps = e.total_steps
        self.allocator = e.allocator
        self.tau_gap_warn = float(e.config.get("eval", {}).get("tau_gap_warn",
                                                              EvalConfig.tau_gap_warn))
        self.target_labels = [str(x) for x in e.targets]
        self.drafter_labels = [str(x) for x in e.drafters]
        self.start_step = e.resumed_from_step or (None if e.resume else 0)
        resumed = f", resumed from step {e.resumed_from_step}" if e.resumed_from_step else ""
        self.add_log("info", "engine", f"run {e.run_name} started in {e.run_dir}{resumed}")
        return {EVERY_PANEL}

    def _on_TrainingPlan(self, e: ev.TrainingPlan) -> set[str]:
        self.plan = e
        self.start_step = e.start_step
        self.total_steps = e.total_steps
        self.add_log("info", "engine", e.summary(), e.ts)
        return {"header", "training", "log"}

    def _on_StateChanged(self, e: ev.StateChanged) -> set[str]:
        self.state, self.reason = e.state, e.reason
        changed = {"header", "log", "targets"}
        if e.state != "preflight":  # preflight builds; a build cut short ends with it
            self.building = None
        if e.state in ev.TERMINAL_STATES:
            self.end_ts = e.ts
            self.ended_in = e.previous
            self.stalls.clear()  # the run's workers are gone
            self.checkpoint_writing = None
            self._log_last_words(e.ts)
            # A worker that said nothing more has stopped (events of an engine that did not
            # publish every worker's last state, or a thread stuck past the end).
            for row in self.targets.values():
                if row.status in _TARGET_AT_WORK:
                    row.status = ev.WORKER_STOPPED
            for name, w in self.workers.items():
                if w.status not in _WORKER_ENDS + (ev.WORKER_FAILED,):
                    self.workers[name] = replace(w, status=ev.WORKER_STOPPED)
            changed = {EVERY_PANEL}  # an empty panel now says why it stayed empty
        elif e.state in LIVE_STATES and self.end_ts is not None:
            # a restart without a new RunStarted: the clock runs again
            self.end_ts, self.end_step, self.ended_in = None, None, ""
        reason = f" ({e.reason})" if e.reason else ""
        level = {"failed": "error", "aborted": "warning"}.get(e.state, "info")
        self.add_log(level, "engine", f"state {e.previous} -> {e.state}{reason}")
        return changed

    def _on_WorkerStatus(self, e: ev.WorkerStatus) -> set[str]:
        self.workers[e.worker] = e
        changed = {"gpus"}
        if e.status in _WORKER_ENDS and self.ended:  # a last word after the run's end: alone
            detail = f" ({e.detail})" if e.detail else ""
            self.add_log("info", e.worker, f"{e.status}{detail}", e.ts)
            changed.add("log")
        if e.role != "target":
            return changed
        row = self._target(e.worker, e.device)
        row.status, row.detail = e.status, e.detail
        if e.status == ev.WORKER_FAILED and e.detail and not row.error:
            row.error = e.detail
        return changed | {"targets"}

    def _log_last_words(self, ts: float) -> None:
        """As the run ends: how each worker ended (its last WorkerStatus), one line for all,
        grouped by how ("stopped: target-0, drafter-0"); a failure has its own error line."""
        by: dict[str, list[str]] = {}
        for name, w in self.workers.items():
            if w.status in _WORKER_ENDS:
                by.setdefault(w.status, []).append(name + (f" ({w.detail})" if w.detail else ""))
        if by:
            self.add_log("info", "workers", "; ".join(f"{status}: {', '.join(names)}"
                                                     for status, names in by.items()), ts)

    def _target(self, worker: str, device: str = "") -> TargetRow:
        row = self.targets.get(worker)
        if row is None:
            row = self.targets[worker] = TargetRow(worker)
        if device:
            row.device = device
        return row

    def _on_LoadProgress(self, e: ev.LoadProgress) -> set[str]:
        row = self._target(e.worker, e.device)
        row.bytes_loaded, row.bytes_total = e.bytes_loaded, e.bytes_total
        row.shards_loaded, row.shards_total = e.shards_loaded, e.shards_total
        row.seconds, row.memory_after = e.seconds, e.memory_after
        if row.status in (TARGET_PENDING, ev.WORKER_LOADING, TARGET_LOADED):
            row.status = TARGET_LOADED if e.done else ev.WORKER_LOADING
        return {"targets"}

    def _on_TargetMetrics(self, e: ev.TargetMetrics) -> set[str]:
        row = self._target(e.worker, e.device)
        row.batches, row.tokens_per_s = e.batches, e.tokens_per_s
        row.blocked_frac, row.starved_frac = e.blocked_frac, e.starved_frac
        if row.status in (TARGET_PENDING, ev.WORKER_LOADING, TARGET_LOADED, ev.WORKER_WARMUP):
            row.status = ev.WORKER_RUNNING  # metrics mean it runs, even if its WorkerStatus is late
        return {"targets", "queues"}

    def _on_GpuSample(self, e: ev.GpuSample) -> set[str]:
        row = self.gpus.setdefault(e.index, GpuRow(e.index))
        row.name, row.mem_used, row.mem_total = e.name, e.mem_used, e.mem_total
        row.util, row.temperature, row.torch_allocated = e.util, e.temperature, e.torch_allocated
        retried = row.sampled and e.alloc_retries > row.alloc_retries
        row.torch_reserved, row.limit = e.torch_reserved, e.limit
        row.alloc_retries, row.ooms = e.alloc_retries, e.ooms
        row.role = e.role
        row.sampled = True
        cap = row.budget
        low = cap > 0 and row.mem_used >= 0 and (cap - row.mem_used) < TIGHT_HEADROOM * cap
        if (low or retried) and not row.tight:
            why = (f"{(cap - row.mem_used) / fmt.GIB:.1f} GiB left of {cap / fmt.GIB:.1f}" if low
                   else f"the allocator had to free its cache {e.alloc_retries} times")
            self.add_log("warning", f"gpu{e.index}", f"memory is tight: {why}; an out-of-memory "
                         "error would make the run back off to smaller sizes", e.ts)
        row.tight = low or retried
        return {"gpus"}

    def _on_Stall(self, e: ev.Stall) -> set[str]:
        if e.cleared:
            if self.stalls.pop(e.worker, None) is None:
                return set()
            self.add_log("info", e.worker, f"progress again ({e.phase})", e.ts)
        else:
            self.stalls[e.worker] = e
            self.add_log("warning", e.worker, f"stalled: no progress for {e.seconds:.0f} s in "
                         f"{e.phase or 'its work'}; {e.where} (s: every worker's stack)", e.ts)
        return {"log", "header"}

    def _on_HostSample(self, e: ev.HostSample) -> set[str]:
        self.host = e
        return {"gpus"}

    def _on_MemoryPlan(self, e: ev.MemoryPlan) -> set[str]:
        # A GPU shared by a target and a drafter may come as two rows: add them up.
        plans: dict[int, list[dict]] = {}
        for r in e.rows:
            idx = device_index(r.get("device", ""))
            if idx is not None:
                plans.setdefault(idx, []).append(r)
        for idx, rows in plans.items():
            row = self.gpus.setdefault(idx, GpuRow(idx))
            row.plan = sum(int(r.get("total", 0)) for r in rows)
            row.plan_fits = all(r.get("fits", True) for r in rows)
            row.plan_role = "+".join(sorted({str(r.get("role", "")) for r in rows} - {""},
                                            reverse=True))
            if not row.plan_fits:
                free = max(int(r.get("free", 0)) for r in rows)
                self.add_log("warning", "preflight", f"memory plan: cuda:{idx} needs "
                             f"{fmt.gib(row.plan)}, {fmt.gib(free)} free")
        return {"gpus", "log"}

    def _on_DrafterMetrics(self, e: ev.DrafterMetrics) -> set[str]:
        self.drafter_times[e.worker] = e
        return {"training"}

    def _on_QueueDepth(self, e: ev.QueueDepth) -> set[str]:
        row = self.queues.get(e.name)
        if row is None:
            row = self.queues[e.name] = QueueRow(e.name)
            self.queues = dict(sorted(self.queues.items(), key=lambda kv: _queue_order(kv[0])))
        row.depth, row.capacity = e.depth, e.capacity
        row.history.append(e.depth)
        return {"queues"}

    def _on_StepMetrics(self, e: ev.StepMetrics) -> set[str]:
        self.step = e
        if e.total_steps:  # RunStarted comes before the data is planned; the total comes here
            self.total_steps = e.total_steps
        self.loss_history.append(e.loss)
        self._step_window.append((e.ts, e.step))
        return {"training", "queues"}

    def _on_NodeStatus(self, e: ev.NodeStatus) -> set[str]:
        last = self.nodes.get(e.node)
        self.nodes = dict(sorted({**self.nodes, e.node: e}.items()))
        if e.error and (last is None or last.error != e.error) and e.node != 0:
            # another node's error: into the log too, named by its node (node 0's are here)
            self.add_log("error", f"node-{e.node}", e.error, e.ts)
            return {"nodes", "log"}
        return {"nodes"}

    def _on_EvalResult(self, e: ev.EvalResult) -> set[str]:
        if e.prompt_set:
            self.set_evals.add(e)
        else:
            self.eval = e
            self.eval_history.append((e.step, e.tau, self.step.tau_tf if self.step else None))
        ctx = context_line(e.context)  # '' unless more than one bucket of context has rounds
        self.add_log("info", "eval", f"step {e.step} on {acceptance.evaluated_on(e)}: "
                     f"{acceptance.summary_line(e)}" + (f" | {ctx}" if ctx else ""))
        return {"training", "log"}

    def _on_DeviceHours(self, e: ev.DeviceHours) -> set[str]:
        self.hours = e
        return {"header"}

    def _on_BuildProgress(self, e: ev.BuildProgress) -> set[str]:
        self.building = None if e.done else e
        return {"header", "targets"}

    def _on_CheckpointProgress(self, e: ev.CheckpointProgress) -> set[str]:
        self.checkpoint_writing = e
        return {"header"}

    def _checkpoint_written(self, step: int) -> None:
        w = self.checkpoint_writing
        if w is not None and w.step <= step:
            self.checkpoint_writing = None

    def _on_Checkpoint(self, e: ev.Checkpoint) -> set[str]:
        self._checkpoint_written(e.step)
        if e.reason == "best":
            self.best = e
            on = f" on {e.prompt_set}" if e.prompt_set else ""  # eval.best_set
            self.add_log("info", "checkpoint", f"best so far: step {e.step} (tau {e.tau:.2f}"
                         f"{on}), {e.path}", e.ts)
            return {"log", "header", "training"}
        self.add_log("info", "checkpoint",
                     f"step {e.step} saved to {e.path} in {e.seconds:.1f}s ({e.reason})")
        return {"log"}

    def _on_Log(self, e: ev.Log) -> set[str]:
        self.add_log(e.level, e.source, e.message)
        return {"log"}

    def _on_Error(self, e: ev.Error) -> set[str]:
        if e.source == "checkpoint":  # a write that failed ends its progress line
            self.checkpoint_writing = None
        row = self.targets.get(e.source)
        if row is not None:
            # "[oom] CUDA out of memory..." reads better than the exception's class name.
            row.error = f"[{e.error_kind}] {fmt.short_message(e.message)}"
            if e.fatal:
                row.status = ev.WORKER_FAILED
        return self.add_error(e) | {"targets"}

    def _on_SinkStatus(self, e: ev.SinkStatus) -> set[str]:
        self.sinks[e.sink] = e
        detail = f": {e.detail}" if e.detail else ""
        self.add_log("warning" if e.status == "failed" else "info", e.sink,
                     f"{e.sink} {e.status}{detail}")
        return {"header", "log"}

    def _on_RunEnded(self, e: ev.RunEnded) -> set[str]:
        self.end_ts = e.ts
        self.end_step = e.step
        if e.status in ev.TERMINAL_STATES:
            self.state = e.status
            self.reason = e.reason or self.reason
        reason = f" ({e.reason})" if e.reason else ""
        self.add_log("error" if e.status == "failed" else "info", "engine",
                     f"run ended: {e.status} at step {e.step} after {fmt.duration(e.seconds)}{reason}")
        return {"header", "log"}

    def add_postmortem(self, pm: PostMortem) -> set[str]:
        """Show what a previous run left behind (sources/postmortem.py) before anything new."""
        for line in pm.lines():
            self.add_log("warning", "post-mortem", line, pm.last_ts)
        if pm.last_error is not None:
            self.add_error(pm.last_error, previous=True)
        return {"log", "errors"}
