"""What the dashboard's panels read off DashboardState without changing it: the run's phase
(live, ended, before which phase it ended, its failure), its clock (elapsed, steps/s, ETA), the
GPU rows with their roles, the bottleneck line, the drafters' time shares, and the latest
evaluation's acceptance per position and mismatch gap.

Apart from dashboard.py, whose handlers fold events into facts: how a number on screen is kept is
there, how it is computed from them is here. DashboardState takes these in as its base, so
they read as its own (``state.eta``); they read only the facts dashboard.py sets.
"""

from __future__ import annotations

from dataclasses import replace

from dflash_core import acceptance
from dflash_core.observe import events as ev

from .. import fmt
from .rows import GpuRow, device_index

LIVE_STATES = ("preflight", "loading", "warmup", "training")
# Below this share of waiting, neither side is called the bottleneck.
BOTTLENECK_FRAC = 0.2
# How a run that ended is said ("the run failed before loading").
_ENDED = {"failed": "failed", "aborted": "was aborted", "finished": "finished"}


class DashboardViews:
    """DashboardState's derived, read-only views (its base; its facts are in dashboard.py)."""

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def ended(self) -> bool:
        return self.state in ev.TERMINAL_STATES

    @property
    def current_step(self) -> int | None:
        """The step the run is at: its last one once it ended, the newest step's, else the one
        it starts from (None while a resume has not said which)."""
        if self.end_step is not None:
            return self.end_step
        if self.step is not None:
            return self.step.step
        return self.start_step

    def ended_before(self, phase: str) -> str:
        """'the run failed before loading' when the run ended before it reached ``phase`` (a
        lifecycle state); "" while it runs or once it got there. An empty panel says it."""
        if not self.ended or self.ended_in not in ev.STATES:
            return ""
        if ev.STATES.index(self.ended_in) >= ev.STATES.index(phase):
            return ""
        return f"the run {_ENDED[self.state]} before {phase}"

    @property
    def failure(self) -> ev.Error | None:
        """The fatal error that ended this run, when it failed."""
        if self.state != "failed":
            return None
        return next((x.event for x in reversed(self.errors)
                     if x.event.fatal and not x.previous), None)

    @property
    def error_count(self) -> int:
        return sum(1 for x in self.errors if not x.previous)

    @property
    def elapsed(self) -> float | None:
        if self.started_ts is None:
            return None
        end = self.end_ts if self.end_ts is not None else self.now
        return max(0.0, end - self.started_ts)

    @property
    def steps_per_s(self) -> float:
        if len(self._step_window) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._step_window[0], self._step_window[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else 0.0

    @property
    def eta(self) -> float | None:
        if self.state != "training" or not self.total_steps or self.step is None:
            return None
        r = self.steps_per_s
        return max(0, self.total_steps - self.step.step) / r if r > 0 else None

    @property
    def wandb(self) -> str:
        s = self.sinks.get("wandb")
        if s is None:
            return ""
        return s.detail if s.status == "ok" and s.detail else f"{s.status}{': ' + s.detail if s.detail else ''}"

    @property
    def cpu_only(self) -> bool:
        labels = self.target_labels + self.drafter_labels
        return not self.gpus and all(device_index(x) is None for x in labels)

    def gpu_rows(self) -> list[GpuRow]:
        """GPU rows in index order. Role: the sample's own, else RunStarted's device labels, else
        the memory plan's."""
        roles: dict[int, set[str]] = {}
        for role, labels in (("target", self.target_labels), ("drafter", self.drafter_labels)):
            for label in labels:
                idx = device_index(label)
                if idx is not None:
                    roles.setdefault(idx, set()).add(role)
        rows = []
        for idx in sorted(set(self.gpus) | set(roles)):
            row = self.gpus.get(idx) or GpuRow(idx)
            if not row.role:
                row = replace(row, role="+".join(r for r in ("target", "drafter") if r in roles[idx])
                              if idx in roles else row.plan_role)
            rows.append(row)
        return rows

    def bottleneck(self) -> str:
        """Which side of the HS queue waits on the other, in words; "" before any flow data."""
        running = [t for t in self.targets.values() if t.status == ev.WORKER_RUNNING]
        if self.step is None and not running:
            return ""
        blocked = max([self.step.target_blocked_frac if self.step else 0.0]
                      + ([sum(t.blocked_frac for t in running) / len(running)] if running else []))
        starved = sum(t.starved_frac for t in running) / len(running) if running else 0.0
        waited = self.step.drafter_wait_frac if self.step else 0.0
        if blocked >= BOTTLENECK_FRAC and blocked >= waited:
            return f"drafter-bound: targets blocked {fmt.pct(blocked)} of the time"
        if waited >= BOTTLENECK_FRAC and starved >= BOTTLENECK_FRAC:
            return (f"data-bound: targets starved {fmt.pct(starved)} of the time, "
                    f"drafter waited {fmt.pct(waited)}")
        if waited >= BOTTLENECK_FRAC:
            return f"target-bound: drafter waited {fmt.pct(waited)} of the time"
        return "balanced"

    def drafter_shares(self) -> dict[str, float] | None:
        """Where the drafters' time went lately, averaged over them (None before any report)."""
        ms = list(self.drafter_times.values())
        if not ms:
            return None
        keys = ("waiting", "compute", "barrier", "step")
        return {k: sum(getattr(m, f"{k}_frac") for m in ms) / len(ms) for k in keys}

    def accepted_by_position(self) -> list[float]:
        """Of the latest evaluation: how often position k (1..) of a drafted block was accepted,
        i.e. the share of rounds that accepted k or more drafted tokens."""
        return acceptance.accepted_at(self.eval.acceptance if self.eval else [])

    @property
    def tau_gap(self) -> float | None:
        """The mismatch gap of the latest evaluation: teacher-forced tau on the target's own
        decoding minus exact tau (an older run's events, without it: the step's teacher-forced
        tau minus exact). None before an evaluation."""
        if self.eval is not None and self.eval.tau_tf_target >= 0:
            return self.eval.tau_tf_target - self.eval.tau
        if not self.eval_history or self.eval_history[-1][2] is None:
            return None
        _, tau, tf = self.eval_history[-1]
        return tf - tau
