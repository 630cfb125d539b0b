"""One drafter worker: take (batch, features) from the hidden-state queue, accumulate gradients on
its replica, and meet the other drafters at the step barrier, where the last to arrive runs the
optimizer step for all of them."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any, Callable

import torch

from dflash_core.checkpoint.data_position import DataPosition
from dflash_core.observe.events import WORKER_RUNNING, WORKER_WARMUP, DrafterMetrics, Log, WorkerStatus
from dflash_core.pipeline.hs_queue import HiddenStateQueue
from dflash_core.models.training.replica import DrafterReplica, StepInterrupted
from dflash_core.pipeline.step_barrier import StepBarrier
from dflash_core.observe.watchdog import Heartbeats
from dflash_core.pipeline.workers import use_device

METRICS_EVERY_S = 1.0


class DrafterStage:
    def __init__(self, rank: int, replica: DrafterReplica, label: str, *,
                 hs_queue: HiddenStateQueue, position: DataPosition, barrier: StepBarrier,
                 grad_accum: int, seed: int, on_step: Callable[[], None],
                 step_of: Callable[[], int], publish: Callable[[Any], None],
                 stop: threading.Event, heartbeats: Heartbeats | None = None):
        self.rank, self.replica, self.label = rank, replica, label
        self.name = f"drafter-{rank}"
        self.hs_queue, self.position, self.barrier = hs_queue, position, barrier
        self.grad_accum, self.seed, self.on_step = grad_accum, seed, on_step
        self.step_of = step_of  # the optimizer steps taken so far
        self.heartbeats = heartbeats or Heartbeats()
        self.publish, self.stop = publish, stop
        self._times = dict.fromkeys(("waiting", "compute", "barrier", "step"), 0.0)
        self._steps = 0
        self._window_t0 = time.monotonic()

    def _beat(self) -> None:
        self.heartbeats.beat("training step")

    def _status(self, status: str, detail: str = "") -> None:
        self.publish(WorkerStatus(worker=self.name, role="drafter", device=self.label,
                                  status=status, detail=detail))

    def run(self) -> None:
        use_device(self.replica.device)
        self._status(WORKER_WARMUP, "first step (kernel compilation)")
        first = True
        ran = [0.0]

        def timed_step():  # only the thread that arrives last runs it
            t = time.monotonic()
            try:
                return self.on_step()
            finally:
                ran[0] = time.monotonic() - t
        while not self.stop.is_set():
            if not self._accumulate_step():
                return
            t, ran[0] = time.monotonic(), 0.0
            if not self.barrier.arrive(timed_step):
                return
            self._times["step"] += ran[0]
            self._times["barrier"] += time.monotonic() - t - ran[0]
            self._steps += 1
            self._report()
            if first:
                first = False
                self._status(WORKER_RUNNING)

    def _report(self) -> None:
        now = time.monotonic()
        span = now - self._window_t0
        if span < METRICS_EVERY_S:
            return
        f = {k: min(1.0, v / span) for k, v in self._times.items()}
        self.publish(DrafterMetrics(worker=self.name, device=self.label, steps=self._steps,
                                    waiting_frac=f["waiting"], compute_frac=f["compute"],
                                    barrier_frac=f["barrier"], step_frac=f["step"]))
        self._times = dict.fromkeys(self._times, 0.0)
        self._steps, self._window_t0 = 0, now

    def _accumulate_step(self) -> bool:
        """Accumulate up to grad_accum batches (fewer at the end of the data); False if stopped.
        An out-of-memory error does not end the run while a smaller pass exists: the step's
        gradients are discarded, the pass made smaller for the rest of the run (fewer sequences,
        then fewer anchors, then recompute with drafter.recompute auto: replica.back_off), and
        every batch of the step trained again, so no sample is skipped or counted twice and the
        optimizer never steps on a partial gradient. The step's batches are kept until it is
        taken (with grad_accum 1, the one batch the drafter holds anyway)."""
        items: list = []
        while len(items) < self.grad_accum and not self.stop.is_set():
            t = time.monotonic()
            item = self.hs_queue.get()
            self._times["waiting"] += time.monotonic() - t
            if item is None:
                if self.hs_queue.exhausted():
                    break
                continue
            items.append(item)
            self._beat()
            todo = [item]
            while todo:
                oom = ""
                try:
                    batch, feats, ready = todo[0]
                    t = time.monotonic()
                    self.replica.accumulate(batch, feats, self.seed, stop=self.stop,
                                            beat=self._beat, ready=ready)
                    self._times["compute"] += time.monotonic() - t
                    todo.pop(0)
                except StepInterrupted:
                    return False
                except torch.OutOfMemoryError as exc:
                    oom = str(exc).splitlines()[0] if str(exc) else "out of memory"
                    change = self.replica.back_off()
                    if change is None:
                        raise
                # Outside the except block: the traceback (and the step's activations it
                # holds) is gone before the memory is given back.
                if oom:
                    self._recover(change, oom)
                    todo = list(items)
        for batch, _, _ in items:
            self.position.taken(self.rank, batch.epoch, batch.batch_index)
        return not self.stop.is_set()

    def _recover(self, change: str, message: str) -> None:
        self.replica.discard_step()
        gc.collect()
        if self.replica.device.type == "cuda":
            torch.cuda.empty_cache()
        self.publish(Log(level="warning", source=self.name, message=(
            f"{self.name}: out of memory at {change}, step {self.step_of() + 1} retried "
            f"({message})")))
