"""A bounded queue of ready batches, filled by a daemon thread ahead of the consumer.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterable, Iterator


_END = object()  # sentinel: the source is exhausted (or failed; then .error is set)


class Prefetcher:
    """A daemon thread that keeps a bounded queue of ready batches ahead of the consumer.

    Every blocking call waits at most ``_POLL`` seconds and then re-checks ``stop``, so ``close()``
    returns promptly even when the queue is full. An exception in the source is kept in ``.error``
    and raised by ``get``; the consumer never hangs on a dead producer.
    """

    _POLL = 0.05

    def __init__(self, source: Iterable[Any], capacity: int, *, pin: bool = False,
                 on_depth: Callable[[int, int], None] | None = None, name: str = "prefetch",
                 stop: threading.Event | None = None,
                 start: bool = True, beat: Callable[[str], None] | None = None,
                 prepare: Callable[[Any], Any] | None = None):
        """``prepare(item)``: more work on each item in the loader thread, before pinning (the
        drafter's anchors and labels). ``beat(phase)``: called from the loader thread at each sign of progress (a batch
        read, a slice of waiting for room), for the engine's stall watchdog. ``on_depth(depth,
        capacity)``: called at each put and take, from either thread (the engine's reporter
        decides which to publish: pipeline/queue_depth.py)."""
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.queue: queue.Queue = queue.Queue(maxsize=capacity)
        self.stop = stop or threading.Event()
        self.error: BaseException | None = None
        self.exhausted = False
        self.produced = 0
        self._source = source
        self._pin = pin
        self._prepare = prepare
        self._on_depth = on_depth
        self._beat = beat or (lambda phase: None)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        if start:
            self.thread.start()

    def start(self) -> None:
        self.thread.start()

    # producer side -----------------------------------------------------------------------

    def _run(self) -> None:
        it = iter(self._source)
        try:
            self._beat("reading data")
            for item in it:
                if self.stop.is_set():
                    return
                if self._prepare is not None:
                    item = self._prepare(item)
                if self._pin and hasattr(item, "pin"):
                    item = item.pin()
                if not self._put(item):
                    return
                self.produced += 1
                self._beat("reading data")
        except BaseException as exc:  # reported to the consumer, never lost in a dead thread
            self.error = exc
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    pass
            self._put(_END)

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=self._POLL)
            except queue.Full:
                self._beat("waiting for room in its prefetch queue")
                continue
            self._report()
            return True
        return False

    # consumer side -----------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> Any | None:
        """The next batch; None on timeout, once stopped, or once exhausted (see ``exhausted``).
        Raises the source's exception if it failed."""
        if self.error is not None:
            raise self.error
        if self.exhausted:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = self._POLL if deadline is None else deadline - time.monotonic()
            try:
                if left > 0:
                    item = self.queue.get(timeout=min(self._POLL, left))
                else:
                    item = self.queue.get_nowait()
                break
            except queue.Empty:
                if self.error is not None:
                    raise self.error
                if (deadline is not None and left <= self._POLL) or self.stop.is_set():
                    return None
        if item is _END:
            if self.error is not None:
                raise self.error
            self.exhausted = True
            return None
        self._report()
        return item

    def __iter__(self) -> Iterator[Any]:
        """Batches until the source ends or ``stop`` is set."""
        while not self.exhausted and not self.stop.is_set():
            item = self.get(timeout=self._POLL)
            if item is not None:
                yield item

    def depth(self) -> int:
        return self.queue.qsize()

    def _report(self) -> None:
        if self._on_depth is None:
            return
        try:
            self._on_depth(self.queue.qsize(), self.capacity)
        except Exception:
            pass  # telemetry must never stop the data flowing

    def close(self, timeout: float = 2.0) -> bool:
        """Stop the thread and drop what is queued; True when the thread is gone."""
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        while True:  # release queued (possibly pinned) batches
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        return not self.thread.is_alive()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
