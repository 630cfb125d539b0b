"""The hidden-state queue: the bounded hand-off of (batch, features) from target workers to
drafter workers, with its depth reports (queue_depth.py) and the time each side spent waiting on
the other."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Any, Callable, NamedTuple

import torch

from dflash_core.observe.events import HS_QUEUE
from dflash_core.pipeline.queue_depth import DepthReporter
from dflash_core.pipeline.workers import POLL_S, Stopped


class Handoff(NamedTuple):
    """One queue item. The features stay on the target's GPU (they count against its memory)
    until a drafter copies them to its own (handoff.FeatureCopier); ``ready`` is the CUDA event
    the target recorded when they were done (None off CUDA)."""

    batch: Any
    features: torch.Tensor
    ready: Any = None


def plan_position(item) -> tuple[int, int]:
    """Where an item's batch stands in the run's plan: (epoch, global batch index)."""
    batch = getattr(item, "batch", None)
    return getattr(batch, "epoch", 0), getattr(batch, "batch_index", 0)


class HiddenStateQueue:
    """Items leave in plan order among those present (earliest epoch and batch index first), not
    in order of arrival: targets drift a batch or two apart, and the batches that meet in one
    optimizer step should be the neighbours the plan put together (data.balance_steps)."""

    def __init__(self, capacity: int, producers: int, publish: Callable[[Any], None],
                 stop: threading.Event, beat: Callable[[str], None] | None = None):
        """``beat(phase)``: called in the waiting thread for each slice of waiting (a worker
        that waits on the other side is alive, not stalled)."""
        self._q: queue.PriorityQueue = queue.PriorityQueue(maxsize=capacity)
        self._arrivals = itertools.count()  # ties (items without a batch) leave in arrival order
        self.capacity = capacity
        self._producers = producers
        self._depth = DepthReporter(HS_QUEUE, publish)
        self._stop = stop
        self._lock = threading.Lock()
        self._done = 0
        self._blocked = 0.0  # producers' time waiting for room, since the last take_waits()
        self._waited = 0.0  # consumers' time waiting for an item, likewise
        self._beat = beat or (lambda phase: None)

    def put(self, item) -> float:
        """Blocks while the queue is full; raises Stopped when the stop flag is set meanwhile.
        Returns the seconds spent waiting for room."""
        t = time.monotonic()
        while True:
            if self._stop.is_set():
                raise Stopped()
            try:
                self._q.put((plan_position(item), next(self._arrivals), item), timeout=POLL_S)
                break
            except queue.Full:
                self._report()  # said again while it waits: the queues panel's history goes on
                self._beat("waiting for room in the hs queue")
        blocked = time.monotonic() - t
        with self._lock:
            self._blocked += blocked
        self._report()
        return blocked

    def get(self, timeout: float = POLL_S):
        """The next item, or None when none came within ``timeout``."""
        t = time.monotonic()
        try:
            item = self._q.get(timeout=timeout)[-1]
        except queue.Empty:
            item = None
            self._beat("waiting for features")
        with self._lock:
            self._waited += time.monotonic() - t
        self._report()  # also on a timeout: the depth last coalesced away reaches the screen
        return item

    def producer_done(self) -> None:
        with self._lock:
            self._done += 1

    def exhausted(self) -> bool:
        """Every producer has finished and nothing is left to take."""
        return self._done >= self._producers and self._q.empty()

    def take_waits(self) -> tuple[float, float]:
        """(consumer wait, producer blocked) seconds since the last call."""
        with self._lock:
            out = (self._waited, self._blocked)
            self._waited = self._blocked = 0.0
        return out

    def depth(self) -> int:
        return self._q.qsize()

    def clear(self) -> None:
        """Drop what is queued (teardown: the tensors go with it)."""
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                return

    def _report(self) -> None:
        self._depth(self._q.qsize(), self.capacity)
