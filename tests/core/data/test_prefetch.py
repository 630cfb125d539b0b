"""The prefetch thread: order, prompt close when blocked, errors passed on."""

from __future__ import annotations

import threading
import time

from dflash_core.data import Batch, DataError, Prefetcher

from tests.core.data.samples import make_stream


def test_prefetcher_delivers_everything_in_order(dataset):
    depths = []
    stream = make_stream(dataset, epochs=1)
    pf = Prefetcher(stream.iter_batches(0), capacity=3, pin=True,
                    on_depth=lambda d, c: depths.append((d, c)))
    got = []
    while True:
        b = pf.get(timeout=5)
        if b is None:
            break
        assert isinstance(b, Batch)
        got.append(b.batch_index)
    assert pf.exhausted and pf.error is None
    assert got == list(range(stream.batches_per_epoch))
    assert depths and all(c == 3 and 0 <= d <= 3 for d, c in depths)
    assert pf.close() and not pf.thread.is_alive()
    assert pf.get(timeout=0.1) is None  # stays exhausted


def test_prefetcher_close_when_blocked_on_full_queue():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    pf = Prefetcher(endless(), capacity=2)
    deadline = time.monotonic() + 5
    while pf.queue.qsize() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pf.queue.full()
    assert pf.get(timeout=1) == 0
    t0 = time.monotonic()
    assert pf.close(timeout=2.0)
    assert time.monotonic() - t0 < 2.0
    assert not pf.thread.is_alive()
    assert pf.thread not in threading.enumerate()


def test_prefetcher_propagates_source_error_and_times_out():
    def failing():
        yield "a"
        yield "b"
        raise DataError("shard went away", file="x.arrow", hint="fix it")

    pf = Prefetcher(failing(), capacity=4)
    items, err = [], None
    try:
        for _ in range(10):
            items.append(pf.get(timeout=2))
    except DataError as exc:
        err = exc
    assert err is not None and "x.arrow" in str(err) and pf.error is err
    assert set(items) <= {"a", "b"}
    assert pf.close()

    slow_started = threading.Event()

    def slow():
        slow_started.set()
        time.sleep(0.3)
        yield 1

    pf = Prefetcher(slow(), capacity=1)
    slow_started.wait(2)
    assert pf.get(timeout=0.05) is None and not pf.exhausted  # timeout, not the end
    assert pf.get() == 1  # no timeout: waits for the slow source
    assert pf.close()
