"""train.log: short human-readable lines, one fact each.

``format_event`` is pure (event -> text or None) and ``LineThrottle`` decides which events are
worth a line; the headless runner reuses both for its console output.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from dflash_core.observe.events import (
    Checkpoint, CheckpointProgress, DeviceHours, DrafterMetrics, Error, Event, EvalResult,
    LoadProgress, Log, MemoryPlan, RunEnded, RunStarted, SinkStatus, Stall, StateChanged,
    StepMetrics, TargetMetrics, TrainingPlan, WorkerStatus,
)
from dflash_core.acceptance import (
    calibration_line, evaluated_on, serving_line, serving_of, summary_line,
)
from dflash_core.context_buckets import context_line
from dflash_core.observe.device_hours import event_line
from dflash_core.models.dspark.calibration import Calibration
from dflash_core.units import GiB, size_text



_gib = size_text


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.1f} s"
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _rate(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.1f}"


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip("\n").splitlines())


def _memory_table(ev: MemoryPlan) -> str:
    header = f"memory plan: {'fits' if ev.fits else 'DOES NOT FIT'}"
    lines = [f"{'device':<10} {'role':<16} {'planned':>10} {'free':>10}  fits  components"]
    for row in ev.rows:
        comps = ", ".join(f"{k} {_gib(v)}" for k, v in (row.get("components") or {}).items())
        lines.append(
            f"{str(row.get('device', '?')):<10} {str(row.get('role', '')):<16} "
            f"{_gib(row.get('total', 0)):>10} {_gib(row.get('free', 0)):>10}  "
            f"{'yes ' if row.get('fits', True) else 'NO  '}  {comps}"
        )
    return header + "\n" + _indent("\n".join(lines), "  ")


# The families' loss terms: DSpark's CE, TV and confidence; DFlash2's CE, selector CE and the
# selector's hit rate (labels among its K candidates). A family's absent ones are -1.
LOSS_TERMS = (("ce", "loss_ce"), ("tv", "loss_tv"), ("conf", "loss_conf"), ("sel", "loss_sel"),
              ("hit", "loss_hit"))


def loss_terms(ev: StepMetrics) -> str:
    """' (ce 2.1 tv 0.84 conf 0.31)' for a DSpark step (its loss's three terms), ' (ce 1.9 sel
    0.62 hit 0.71)' for DFlash2's, else ''."""
    got = [(name, getattr(ev, key, -1.0)) for name, key in LOSS_TERMS]
    if all(v < 0 for _, v in got):
        return ""
    return " (" + " ".join(f"{name} {v:.4f}" for name, v in got if v >= 0) + ")"


def format_event(ev: Event) -> str | None:
    """One short text (maybe several lines) for an event, or None for events not worth a line."""
    if not ev.in_text_log:
        return None
    if isinstance(ev, StepMetrics):
        return (
            f"step {ev.step} epoch {ev.epoch} loss {ev.loss:.4f}{loss_terms(ev)} lr {ev.lr:.2e} "
            f"gnorm {ev.grad_norm:.3f} tau_tf {ev.tau_tf:.2f} tok/s {_rate(ev.tokens_per_s)} "
            f"samples/s {ev.samples_per_s:.2f} drafter-wait {ev.drafter_wait_frac:.0%} "
            f"target-blocked {ev.target_blocked_frac:.0%}"
        )
    if isinstance(ev, StateChanged):
        reason = f" ({ev.reason})" if ev.reason else ""
        return f"state {ev.previous} -> {ev.state}{reason}"
    if isinstance(ev, LoadProgress):
        if ev.done:
            after = f", {_gib(ev.memory_after)} on device" if ev.memory_after else ""
            return (f"load {ev.worker} {ev.device} done: {_gib(ev.bytes_total)} in "
                    f"{_duration(ev.seconds)}{after}")
        pct = ev.bytes_loaded / ev.bytes_total if ev.bytes_total else 0.0
        return (f"load {ev.worker} {ev.device}: {pct:.0%} {_gib(ev.bytes_loaded)}/"
                f"{_gib(ev.bytes_total)}, shards {ev.shards_loaded}/{ev.shards_total}, "
                f"{_duration(ev.seconds)}")
    if isinstance(ev, EvalResult):
        hist = " ".join(f"{k}:{n}" for k, n in enumerate(ev.acceptance))
        took = f" in {_duration(ev.seconds)}" if ev.seconds > 0 else ""  # what eval.every costs
        cal = Calibration.from_dict(getattr(ev, "calibration", None))
        cal_line = calibration_line(cal) if cal is not None else ""
        sc = serving_of(ev)  # serving's counts (None: an older event, its line as it was)
        serving = f"; {serving_line(sc)}" if sc is not None else ""
        dtype = getattr(ev, "drafter_dtype", "")
        # tau per bucket of context length, when more than one bucket has rounds
        ctx = context_line(getattr(ev, "context", None))
        return (f"eval step {ev.step} on {evaluated_on(ev)}{took}: {summary_line(ev)}; "
                f"accepted/round {hist}{serving}" + (f"; {ctx}" if ctx else "")
                + (f"; {cal_line}" if cal_line else "")
                + (f"; drafter in {dtype}" if dtype else ""))
    if isinstance(ev, Checkpoint):
        size = (f", {ev.bytes / GiB:.1f} GiB at {ev.bytes / GiB / ev.seconds:.2f} GiB/s, training "
                f"blocked {ev.blocked_s:.1f} s" if ev.bytes and ev.seconds > 0 else "")
        why = ev.reason
        if ev.reason == "best":  # what made it the best: the exact tau and where it was measured
            why += f", exact tau {ev.tau:.2f}" + (f" on set {ev.prompt_set}" if ev.prompt_set
                                                  else "")
        return f"checkpoint step {ev.step} ({why}) in {_duration(ev.seconds)}{size}: {ev.path}"
    if isinstance(ev, DeviceHours):  # an evaluation's and the end's; the periodic ones are not
        return event_line(ev) if ev.reason in ("eval", "end") else None
    if isinstance(ev, CheckpointProgress):
        rate = ev.bytes_written / GiB / ev.seconds if ev.seconds > 0 else 0.0
        return (f"writing checkpoint step {ev.step} ({ev.reason}): {ev.bytes_written / GiB:.1f} of "
                f"{ev.bytes_total / GiB:.1f} GiB, {rate:.2f} GiB/s")
    if isinstance(ev, Log):
        return f"[{ev.level}] {ev.source}: {ev.message}"
    if isinstance(ev, Stall):
        if ev.cleared:
            return f"[warning] {ev.worker}: progress again ({ev.phase})"
        return (f"[warning] {ev.worker} stalled: no progress for {_duration(ev.seconds)} in "
                f"{ev.phase or 'its work'}; {ev.where}\n" + _indent(ev.stack))
    if isinstance(ev, Error):
        where = ", ".join(x for x in (ev.device, ev.phase) if x)
        where = f" ({where})" if where else ""
        text = (f"ERROR [{ev.error_kind}] {ev.source}{where}{' fatal' if ev.fatal else ''}: "
                f"{ev.message}")
        if ev.hint:
            text += f"\n  hint: {ev.hint}"
        if ev.traceback:
            text += "\n" + _indent(ev.traceback)
        return text
    if isinstance(ev, RunStarted):
        resumed = f", resumed from step {ev.resumed_from_step}" if ev.resumed_from_step else ""
        total = f", {ev.total_steps} steps" if ev.total_steps else ""
        return (f"run {ev.run_name} started in {ev.run_dir}: targets {ev.targets}, "
                f"drafters {ev.drafters}{total}{resumed}")
    if isinstance(ev, TrainingPlan):
        return ev.summary()
    if isinstance(ev, RunEnded):
        reason = f" ({ev.reason})" if ev.reason else ""
        return f"run {ev.status} at step {ev.step} after {_duration(ev.seconds)}{reason}"
    if isinstance(ev, MemoryPlan):
        return _memory_table(ev)
    if isinstance(ev, SinkStatus):
        return f"sink {ev.sink}: {ev.status}{f' ({ev.detail})' if ev.detail else ''}"
    if isinstance(ev, WorkerStatus):
        detail = f" ({ev.detail})" if ev.detail else ""
        return f"worker {ev.worker} {ev.device}: {ev.status}{detail}"
    if isinstance(ev, TargetMetrics):
        return (f"target {ev.worker} {ev.device}: {ev.batches} batches, tok/s "
                f"{_rate(ev.tokens_per_s)}, blocked {ev.blocked_frac:.0%}, "
                f"starved {ev.starved_frac:.0%}")
    if isinstance(ev, DrafterMetrics):
        return (f"drafter {ev.worker} {ev.device}: {ev.steps} steps, waiting {ev.waiting_frac:.0%}, "
                f"compute {ev.compute_frac:.0%}, barrier {ev.barrier_frac:.0%}, "
                f"step {ev.step_frac:.0%}")
    return None  # an event type without a line of its own


class LineThrottle:
    """Keeps a log short: periodic events at most once per ``every_s`` (by event time, so a
    replay gives the same lines), load progress only at each new 10% and when done."""

    def __init__(self, every_s: float = 5.0):
        self.every_s = every_s
        self._last_ts: dict[tuple, float] = {}
        self._load_decile: dict[str, int] = {}

    def admit(self, ev: Event) -> bool:
        if isinstance(ev, (StepMetrics, TargetMetrics, DrafterMetrics, CheckpointProgress)):
            key = (ev.kind, getattr(ev, "worker", ""))
            last = self._last_ts.get(key)
            if last is not None and ev.ts - last < self.every_s:
                return False
            self._last_ts[key] = ev.ts
            return True
        if isinstance(ev, LoadProgress):
            if ev.done:
                self._load_decile.pop(ev.worker, None)  # a reload starts counting afresh
                return True
            decile = int(10 * ev.bytes_loaded / ev.bytes_total) if ev.bytes_total else 0
            if decile <= self._load_decile.get(ev.worker, -1):
                return False
            self._load_decile[ev.worker] = decile
            return True
        return True


def _stamp(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


class TextLogSink:
    """Append human-readable lines to ``path`` (train.log). Extra lines of one event (traceback,
    table) are indented under its time-stamped first line."""

    def __init__(self, path: str | os.PathLike, every_s: float = 5.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._throttle = LineThrottle(every_s)
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8")

    def __call__(self, ev: Event) -> None:
        text = format_event(ev)
        if text is None or not self._throttle.admit(ev):
            return
        first, *rest = text.split("\n")
        lines = [f"{_stamp(ev.ts)} {first}"] + [f"{' ' * 20}{line}" for line in rest]
        with self._lock:
            if self._file is None:
                return
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()  # so `tail -f train.log` is live

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
