"""Checkpoints written in the background: training stops only while one step boundary's state is
copied to host memory, and writer processes put it on disk while the drafters train on.

- Staging (staging.py): one host buffer (an arena) holding every tensor of a checkpoint,
  allocated once and reused. It lives in shared memory so the writer processes read it without
  a copy, and is pinned (registered with CUDA) so device copies are DMA at full bus speed.
  ``stage`` issues each tensor's copy on a side stream of its device (non_blocking), then waits
  once per device.
  Data-parallel replicas hold the same state, so replica r copies the tensors writer r writes:
  every GPU's link carries only its share.
- Writers (writer_loop.py): one ``spawn`` process per share (the dashboard, telemetry and
  workers share this interpreter; a write must not take its time). Each gets the arena once and,
  per checkpoint, the list of files to write from it (save_load.plan_files); it reports bytes
  written through a shared counter and its end, with its files' checksums, through a queue. This
  process assembles the folder (save_load.begin_save / finish_save: checksums.json from every
  writer's report, written last), so the atomic rename stays here: a writer killed mid-write
  leaves a hidden folder that is removed, and the previous checkpoint stands. A dead writer is
  reported and replaced at the next checkpoint; if no process can be started the writes go to
  threads of this process instead (``mode`` "thread").
- One write at a time: a checkpoint asked for while one is in flight waits for it (the arena is
  in use), it never overwrites it.

torch.distributed.checkpoint's async save was the other option; it writes its own layout
(a .metadata file and per-rank .distcp files) that the public reference cannot load, so the
interchange folder (model.safetensors + config.json) would need a second write anyway, and it
needs a process group where this engine has none on one node.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing  # noqa: F401 - registers how tensors travel to a process

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint import writer_loop
from dflash_core.checkpoint.layout import CHECKPOINTS, CheckpointError
from dflash_core.checkpoint.staging import Staging
from dflash_core.checkpoint.writer_loop import POLL_S, serve, writer_main

PROGRESS_EVERY_S = 1.0
PROBE_BYTES = 256 << 20


# --------------------------------------------------------------------------------------------
# The checkpointer: stage, hand out, watch, assemble
# --------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """How one background checkpoint ended."""

    step: int
    path: Path | None  # the step-N folder, None when it failed
    bytes: int
    seconds: float  # from staging to durable
    blocked_s: float  # training stopped for this (waiting on the last write, then staging)
    error: str = ""  # why it failed ("" when it did not)
    errno: int | None = None
    abandoned: bool = False  # stopped by kill() (an abort out of time): its caller says so
    notes: list[str] = field(default_factory=list)  # warnings (a damaged folder set aside)


@dataclass
class _Job:
    id: int
    step: int
    tmp: Path
    plans: list
    bytes_total: int
    keep: int
    reason: str
    started: float
    blocked_s: float
    on_done: Callable[[Outcome], None] | None
    pending: set
    error: str = ""
    errno: int | None = None
    outcome: Outcome | None = None
    abandoned: bool = False
    write_s: float = 0.0  # the slowest writer's own time for its files
    sums: dict = field(default_factory=dict)  # each file's checksum entry, as reported
    notes: list = field(default_factory=list)


class CheckpointWriter:
    """Background checkpoints of one run. ``publish`` gets progress (``on_progress``) and
    failures are returned in Outcomes; ``beat`` is called while a write makes progress (the
    stall watchdog sees the monitor thread as alive). The write rate is measured by the writers
    themselves (the time a process takes to start is not the disk's). ``target``: the writer processes' entry
    point (default: ``writer_main``, looked up when the writer is made, so tests can swap in one
    that fails)."""

    def __init__(self, run_dir: Path, writers: int, *, mode: str = "process",
                 on_progress: Callable[[int, int, int, float, str], None] | None = None,
                 beat: Callable[[], None] | None = None, target: Callable | None = None):
        self.run_dir = Path(run_dir)
        self.writers = max(1, writers)
        self.mode = mode
        self.on_progress, self.beat = on_progress, beat
        self.target = target if target is not None else writer_main
        self.staging = Staging(shared=mode == "process")
        self.progress = torch.zeros(self.writers, dtype=torch.int64)
        if mode == "process":
            self.progress.share_memory_()
        self._ctx = multiprocessing.get_context("spawn") if mode == "process" else None
        self._procs: list[Any] = [None] * self.writers
        self._jobs: list[Any] = [None] * self.writers
        self._results: Any = None
        self._lock = threading.Lock()
        self._job: _Job | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._next_id = 0
        self._monitor: threading.Thread | None = None
        self._closed = False
        self._cancel = threading.Event()  # kill() of writer threads: their write stops
        self.rate: float | None = None  # bytes/s of the last write (or the probe)
        self.staging_s = 0.0  # the last checkpoint's copy to host memory
        self.notes: list[str] = []  # what changed about the writers (deaths, fallbacks)

    # -- writers -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every writer that is not running (non-blocking: a process imports torch on
        its own time)."""
        if self._results is None:
            self._results = self._ctx.Queue() if self.mode == "process" else queue.Queue()
        for i in range(self.writers):
            if self._alive(i):
                continue
            if self.mode == "process":
                try:
                    q = self._ctx.Queue()
                    p = self._ctx.Process(target=self.target, name=f"checkpoint-writer-{i}",
                                          args=(i, q, self._results, self.progress), daemon=True)
                    p.start()
                except (OSError, RuntimeError) as exc:
                    self._fall_back(f"cannot start a writer process ({exc})")
                    return self.start()
                self._procs[i], self._jobs[i] = p, q
                if self.staging.layout:
                    q.put(("arena", self.staging.arena, self.staging.layout))
            else:
                q = queue.Queue()
                t = threading.Thread(target=serve, name=f"checkpoint-writer-{i}", daemon=True,
                                     args=(i, q, self._results, self.progress,
                                           lambda: not self._closed, self._cancel.is_set))
                t.start()
                self._procs[i], self._jobs[i] = t, q
                if self.staging.layout:
                    q.put(("arena", self.staging.arena, self.staging.layout))

    def _fall_back(self, why: str) -> None:
        self.notes.append(f"checkpoints are written by threads of this process: {why}")
        self.mode = "thread"
        self._results = queue.Queue()
        self._procs = [None] * self.writers
        layout = dict(self.staging.layout)
        self.staging.close()
        self.staging = Staging(shared=False)
        if layout:
            self.staging.ensure({n: torch.empty(s, dtype=d, device="meta")
                                 for n, (o, s, d) in layout.items()})

    def _alive(self, i: int) -> bool:
        p = self._procs[i]
        return p is not None and p.is_alive()

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p is not None and self.mode == "process"]

    def reserve(self, tensors: dict[str, Any]) -> bool:
        """Make the arena for tensors of these names, shapes and dtypes now (warm-up), so the
        first checkpoint only copies. True when it was (re)made."""
        self.wait_idle()
        made = self.staging.ensure(tensors)
        if made:
            self._send_arena()
        return made

    def _send_arena(self) -> None:
        for i in range(self.writers):
            if self._alive(i):
                self._jobs[i].put(("arena", self.staging.arena, self.staging.layout))

    def probe(self, nbytes: int = PROBE_BYTES, timeout: float = 120.0) -> float | None:
        """Measure the write rate (bytes/s) with every writer writing its share of ``nbytes``
        at once."""
        self.start()
        root = self.run_dir / CHECKPOINTS
        root.mkdir(parents=True, exist_ok=True)
        self._idle.wait()
        job_id = self._new_id()
        share = max(1 << 16, nbytes // self.writers)
        t0 = writer_loop.clock()
        for i in range(self.writers):
            self._jobs[i].put(("probe", job_id, str(root / f".probe-{os.getpid()}-{i}"), share))
        left = set(range(self.writers))
        took = 0.0  # the slowest writer's own time: a process's start is not the disk's
        while left and writer_loop.clock() - t0 < timeout:
            try:
                msg = self._results.get(timeout=POLL_S)
            except queue.Empty:
                if not all(self._alive(i) for i in left):
                    return None
                continue
            if msg[1] != job_id:
                continue
            if msg[0] == "error":
                return None
            left.discard(msg[2])
            took = max(took, msg[4])
        if left:
            return None
        self.rate = share * self.writers / max(took, 1e-6)
        return self.rate

    def estimate_s(self, nbytes: int) -> float | None:
        """Seconds a checkpoint of ``nbytes`` takes from staging to durable, by the last
        measurements (None before any)."""
        return self.staging_s + nbytes / self.rate if self.rate else None

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # -- one checkpoint ------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    @property
    def in_flight(self) -> _Job | None:
        return self._job

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait for the write in flight; ``beat`` while it makes progress."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = -1
        while not self._idle.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._idle.wait(POLL_S)
            now = int(self.progress.sum())
            if now != seen and self.beat is not None:
                self.beat()
            seen = now
        return True

    def save(self, job: ckpt.SaveJob, sources: list[dict[str, torch.Tensor]], *, keep: int,
             reason: str = "periodic", on_done: Callable[[Outcome], None] | None = None
             ) -> float:
        """Stage ``job`` (its tensors come from ``sources``, one dict per replica, holding the
        same values) and hand it to the writers; returns the seconds training was blocked.
        Raises CheckpointError (nothing written) when even the folder cannot be made."""
        t0 = writer_loop.clock()
        self.wait_idle()
        self._cancel.clear()
        if self.staging.ensure(job.tensors):
            self._send_arena()
        owner = {src: w for w, files in enumerate(job.plans) for f in files
                 for _, src, _ in f.entries if f.name != "model.safetensors"}
        t_stage = writer_loop.clock()
        self.staging.stage(sources, owner, job.static)
        self.staging_s = writer_loop.clock() - t_stage
        tmp = ckpt.begin_save(self.run_dir, job)
        self.start()  # a writer that died since the last checkpoint is replaced
        blocked = writer_loop.clock() - t0
        j = _Job(self._new_id(), job.step, tmp, job.plans, job.bytes_total, keep, reason, t0,
                 blocked, on_done, set(range(self.writers)), sums=dict(job.sums))
        self.progress.zero_()
        self._idle.clear()
        self._job = j
        for i in range(self.writers):
            self._jobs[i].put(("write", j.id, str(tmp), job.plans[i]))
        self._monitor = threading.Thread(target=self._watch, args=(j,), daemon=True,
                                         name="checkpoint-monitor")
        self._monitor.start()
        return blocked

    def wait(self, timeout: float | None = None) -> Outcome | None:
        """The outcome of the write in flight once it ends (None: still writing at timeout, or
        nothing was in flight)."""
        j = self._job
        if j is None:
            return None
        if not self.wait_idle(timeout):
            return None
        return j.outcome

    def _watch(self, j: _Job) -> None:
        last_report = 0.0
        dead: list[str] = []
        while j.pending:
            try:
                msg = self._results.get(timeout=POLL_S)
            except queue.Empty:
                msg = None
            if msg is not None and msg[1] == j.id:
                j.pending.discard(msg[2])
                if msg[0] == "done":
                    j.write_s = max(j.write_s, msg[4])
                    j.sums.update(msg[5])
                if msg[0] == "error" and not j.error:
                    j.errno, j.error = msg[3], msg[4]
            for i in list(j.pending):
                if not self._alive(i):  # killed, or crashed, mid-write
                    p = self._procs[i]
                    code = getattr(p, "exitcode", None)
                    how = (f"killed by {signal.Signals(-code).name}" if code is not None
                           and code < 0 else f"exit code {code}")
                    dead.append(f"writer {i} (pid {getattr(p, 'pid', '?')}) died ({how})")
                    j.pending.discard(i)
            now = writer_loop.clock()
            written = int(self.progress.sum())
            if self.beat is not None:
                self.beat()
            if self.on_progress is not None and now - last_report >= PROGRESS_EVERY_S:
                last_report = now
                self.on_progress(j.step, written, j.bytes_total, now - j.started, j.reason)
        if dead and not j.error:
            j.error = "; ".join(dead) + " while writing"
            self.notes.append(j.error)
        path = None
        if not j.error:
            try:
                path = ckpt.finish_save(self.run_dir, j.step, j.tmp, j.keep, j.sums,
                                        note=j.notes.append)
            except CheckpointError as exc:
                j.error, j.errno = str(exc), exc.errno
        if j.error:
            ckpt.abandon_save(j.tmp)
        seconds = writer_loop.clock() - j.started
        written = int(self.progress.sum())
        if path is not None and j.write_s > 0:
            self.rate = j.bytes_total / j.write_s
        j.outcome = Outcome(j.step, path, written if j.error else j.bytes_total, seconds,
                            j.blocked_s, j.error, j.errno, j.abandoned, list(j.notes))
        try:
            if j.on_done is not None:
                j.on_done(j.outcome)
        finally:
            self._idle.set()

    # -- the end -------------------------------------------------------------------------------
    def kill(self) -> None:
        """Stop every writer now (an abort that ran out of time): processes are killed, threads
        stop their write at the next chunk. The write in flight ends abandoned, its hidden
        folder removed."""
        j = self._job
        if j is not None and not self._idle.is_set():
            j.abandoned = True
        self._cancel.set()
        for p in self._procs:
            if p is not None and self.mode == "process" and p.is_alive():
                p.kill()

    def close(self, timeout: float = 5.0) -> None:
        """Wait for the write in flight (``timeout``), end the writers, free the arena."""
        self.wait_idle(timeout)
        self._closed = True
        for i, q in enumerate(self._jobs):
            if q is not None and self._alive(i):
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        idle = self._idle.is_set()
        for p in self._procs:
            if p is None:
                continue
            if idle and self.mode == "process":
                p.kill()  # nothing in flight: no need to wait for its interpreter to wind down
            p.join(timeout)
            if self.mode == "process" and p.is_alive():
                p.kill()
                p.join(1.0)
        self._procs = [None] * self.writers
        if self._idle.is_set():
            self.staging.close()


__all__ = ["CheckpointWriter", "Outcome"]
