"""The hidden-state queue: the bounded hand-off of (batch, features) from target workers to
drafter workers, with its depth reports (queue_depth.py) and the time each side spent waiting on
the other."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Any, Callable, Iterable, NamedTuple

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
    """Items leave in plan order, not in order of arrival: targets drift apart, and the
    batches that meet in one optimizer step should be the neighbours the plan put together
    (data.balance_steps). Given ``order`` (the plan positions this node's targets produce, in plan
    order: BatchStream.positions), an item leaves only when every item before it has; without
    it, the earliest of those present leaves first.

    Each producer (a target, whose GPU holds the features it queued) has at most its share,
    ceil(capacity / producers), in the queue: a target running ahead of one the order waits
    for cannot fill the queue with its own batches, and its memory stays what the plan gave it
    (planning/memory.py)."""

    def __init__(self, capacity: int, producers: int, publish: Callable[[Any], None],
                 stop: threading.Event, beat: Callable[[str], None] | None = None,
                 order: Iterable[tuple[int, int]] | None = None):
        """``beat(phase)``: called in the waiting thread for each slice of waiting (a worker
        that waits on the other side is alive, not stalled)."""
        self._heap: list = []
        self._share = -(-capacity // max(1, producers))
        self._held: dict[Any, int] = {}  # items in the queue by producer
        self._cv = threading.Condition()
        self._arrivals = itertools.count()  # ties (items without a batch) leave in arrival order
        self.capacity = capacity
        self._producers = producers
        self._depth = DepthReporter(HS_QUEUE, publish)
        self._stop = stop
        self._done = 0
        self._blocked = 0.0  # producers' time waiting for room, since the last take_waits()
        self._waited = 0.0  # consumers' time waiting for an item, likewise
        self._beat = beat or (lambda phase: None)
        self._order = iter(order if order is not None else ())
        self._due = next(self._order, None)  # None: nothing awaited, the earliest present leaves

    def _is_due(self, position: tuple[int, int]) -> bool:
        """Whether an item at ``position`` may leave now (called holding the lock). An item
        the order does not hold back (it is past the order's end, or comes before the position
        awaited) leaves at once, and so does everything once every producer is done: the order
        only ever delays, it never keeps an item."""
        return (self._due is None or position <= self._due
                or self._done >= self._producers)

    def put(self, item, producer: Any = None) -> float:
        """Blocks while the queue is full or ``producer`` (None: not counted) holds its share;
        raises Stopped when the stop flag is set meanwhile. The item the order awaits always gets
        in (the queue may then hold one over capacity): otherwise later items could fill it and
        wait forever for the one they follow. (Its producer never holds its share then: a
        producer makes its batches in plan order, so any it had queued would come before it.)
        Returns the seconds spent waiting for room."""
        t = time.monotonic()
        position = plan_position(item)
        while True:
            with self._cv:
                if self._stop.is_set():
                    raise Stopped()
                awaited = self._due is not None and position == self._due
                if awaited or (len(self._heap) < self.capacity
                               and self._held.get(producer, 0) < self._share):
                    heapq.heappush(self._heap, (position, next(self._arrivals), producer, item))
                    if producer is not None:
                        self._held[producer] = self._held.get(producer, 0) + 1
                    self._cv.notify_all()
                    break
                self._cv.wait(POLL_S)
            self._report()  # said again while it waits: the queues panel's history goes on
            self._beat("waiting for room in the hs queue")
        blocked = time.monotonic() - t
        with self._cv:
            self._blocked += blocked
        self._report()
        return blocked

    def get(self, timeout: float = POLL_S):
        """The next item, or None when none came within ``timeout``."""
        t = time.monotonic()
        item = None
        with self._cv:
            while True:
                if self._heap and self._is_due(self._heap[0][0]):
                    position, _, producer, item = heapq.heappop(self._heap)
                    if producer is not None:
                        self._held[producer] -= 1
                    if position == self._due:
                        self._due = next(self._order, None)
                    self._cv.notify_all()  # room for a producer
                    break
                left = t + timeout - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            self._waited += time.monotonic() - t
        if item is None:
            self._beat("waiting for features")
        self._report()  # also on a timeout: the depth last coalesced away reaches the screen
        return item

    def producer_done(self) -> None:
        with self._cv:
            self._done += 1
            self._cv.notify_all()  # nothing held back for an order that can no longer come

    def exhausted(self) -> bool:
        """Every producer has finished and nothing is left to take."""
        with self._cv:
            return self._done >= self._producers and not self._heap

    def take_waits(self) -> tuple[float, float]:
        """(consumer wait, producer blocked) seconds since the last call."""
        with self._cv:
            out = (self._waited, self._blocked)
            self._waited = self._blocked = 0.0
        return out

    def depth(self) -> int:
        with self._cv:
            return len(self._heap)

    def clear(self) -> None:
        """Drop what is queued (teardown: the tensors go with it)."""
        with self._cv:
            self._heap.clear()
            self._held.clear()
            self._cv.notify_all()

    def _report(self) -> None:
        self._depth(self.depth(), self.capacity)
