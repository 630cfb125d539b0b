"""The hidden-state queue hands drafters the batches the plan put together."""

import threading
from types import SimpleNamespace

import pytest

from dflash_core.pipeline.hs_queue import Handoff, HiddenStateQueue
from dflash_core.pipeline.workers import Stopped


def handoff(epoch: int, index: int) -> Handoff:
    return Handoff(SimpleNamespace(epoch=epoch, batch_index=index), features=None)


def test_items_leave_in_plan_order_among_those_present():
    """Two targets drift apart: target 1's batches 3 and 5 arrive before target 0's batch 2.
    A drafter still takes 2 first, then 3, then the next epoch's 0 after every batch of this one."""
    q = HiddenStateQueue(8, producers=2, publish=lambda ev: None, stop=threading.Event())
    for epoch, index in [(0, 3), (0, 5), (1, 0), (0, 2), (0, 4)]:
        q.put(handoff(epoch, index))
    taken = [q.get() for _ in range(5)]
    assert [(h.batch.epoch, h.batch.batch_index) for h in taken] == [
        (0, 2), (0, 3), (0, 4), (0, 5), (1, 0)]
    assert q.get(timeout=0.01) is None


def test_items_without_a_plan_position_keep_arrival_order():
    q = HiddenStateQueue(4, producers=1, publish=lambda ev: None, stop=threading.Event())
    for x in ("a", "b", "c"):
        q.put(x)
    assert [q.get() for _ in range(3)] == ["a", "b", "c"]


def test_a_full_queue_blocks_until_stopped():
    stop = threading.Event()
    q = HiddenStateQueue(1, producers=1, publish=lambda ev: None, stop=stop)
    q.put(handoff(0, 1))
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(Stopped):
        q.put(handoff(0, 0))
    assert q.depth() == 1
