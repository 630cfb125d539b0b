"""The depth reports of the run's queues (the prefetch queues and the hs queue), one rule for all:
as QueueDepth events, a few a second, and at once when a queue becomes empty or full."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from dflash_core.observe.events import QueueDepth

REPORT_EVERY_S = 0.2  # a screen needs a few a second; more would only fill events.jsonl


class DepthReporter:
    """Called with a queue's depth at each put and take (from any thread). Reports the depth at
    most every REPORT_EVERY_S (again while it stays the same: the queues panel draws a history),
    but empty and full, the states an operator looks for, as soon as the queue reaches them."""

    def __init__(self, name: str, publish: Callable[[Any], None]):
        self.name = name
        self._publish = publish
        self._lock = threading.Lock()
        self._last = (-1, float("-inf"))  # (depth, time) of the last report

    def __call__(self, depth: int, capacity: int) -> None:
        now = time.monotonic()
        with self._lock:
            last_depth, last_t = self._last
            edge = depth in (0, capacity) and depth != last_depth
            if not edge and now - last_t < REPORT_EVERY_S:
                return
            self._last = (depth, now)
        self._publish(QueueDepth(name=self.name, depth=depth, capacity=capacity))
