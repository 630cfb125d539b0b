"""The bus that carries events from the engine to every subscriber.

Every subscriber gets its own bounded queue and thread: a slow or broken subscriber never blocks
``publish`` (the training loop) and never stops the others. A subscriber that raises is reported
once, as an Error event on the same bus, and gets nothing more.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from dflash_core.observe.errors import classify, error_from_exception
from dflash_core.observe.events import Event

_STOP = object()


class _Subscription:
    def __init__(self, bus: "EventBus", name: str, callback: Callable[[Event], None],
                 maxsize: int, critical: bool):
        self.bus = bus
        self.name = name
        self.callback = callback
        self.critical = critical  # a critical sink's failure is reported as fatal
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.dropped = 0
        self.failed = False
        self.thread = threading.Thread(target=self._run, name=f"sink-{name}", daemon=True)
        self.thread.start()

    def offer(self, event: Event) -> None:
        if self.failed:
            return
        try:
            self.queue.put_nowait(event)
        except queue.Full:
            # Never block the publisher: drop, and count what was dropped.
            self.dropped += 1

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is _STOP:
                self.queue.task_done()
                return
            try:
                if not self.failed:
                    self.callback(item)
            except Exception as exc:  # a broken sink must not take the run down
                self.failed = True
                error_kind, _ = classify(exc, role="sink", device="", phase="")
                self.bus.publish(error_from_exception(
                    exc, error_kind=error_kind,
                    source=f"sink:{self.name}", fatal=self.critical,
                    hint=getattr(exc, "hint", "")
                    or (f"the {self.name} log stopped: the run stops so no record is lost; "
                        "check the run folder's disk and permissions" if self.critical else
                        f"the {self.name} subscriber stopped; the run goes on without it"),
                ))
            finally:
                self.queue.task_done()

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.queue.put(_STOP, timeout=0.05)
                break
            except queue.Full:
                if time.monotonic() > deadline:
                    return
        self.thread.join(max(0.0, deadline - time.monotonic()))


class EventBus:
    """Fan-out of events to subscribers, each on its own thread with its own bounded queue."""

    def __init__(self) -> None:
        self._subs: list[_Subscription] = []
        self._lock = threading.RLock()
        self._taps: list[Callable[[Event], None]] = []

    def subscribe(self, name: str, callback: Callable[[Event], None], *, maxsize: int = 100_000,
                  critical: bool = False) -> _Subscription:
        sub = _Subscription(self, name, callback, maxsize, critical)
        with self._lock:
            self._subs.append(sub)
        return sub

    def tap(self, callback: Callable[[Event], None]) -> None:
        """Synchronous listener, called in the publisher's thread. Must be fast and non-blocking
        (e.g. Textual's post_message, or appending to a list in tests)."""
        with self._lock:
            self._taps.append(callback)

    def untap(self, callback: Callable[[Event], None]) -> None:
        with self._lock:
            if callback in self._taps:
                self._taps.remove(callback)

    def unsubscribe(self, sub: _Subscription, timeout: float = 5.0) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
        sub.close(timeout)

    def publish(self, event: Event) -> None:
        # Under the lock, so every subscriber sees events from several threads in one order.
        # offer() never blocks; a tap that publishes re-enters (RLock).
        with self._lock:
            for sub in self._subs:
                sub.offer(event)
            for cb in list(self._taps):
                try:
                    cb(event)
                except Exception:
                    pass  # a tap is best-effort by contract

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until every subscriber has handled what was published so far."""
        deadline = time.monotonic() + timeout
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            while sub.queue.unfinished_tasks and not sub.failed:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
        return True

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            subs, self._subs = self._subs, []
        for sub in subs:
            sub.close(timeout)
