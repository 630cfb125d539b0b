"""The hidden-state queue hands drafters the batches the plan put together."""

import threading
import time
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


def ordered(capacity: int, order, producers: int = 2, stop=None) -> HiddenStateQueue:
    return HiddenStateQueue(capacity, producers=producers, publish=lambda ev: None,
                            stop=stop or threading.Event(), order=order)


def test_with_an_order_an_item_waits_for_the_one_before_it():
    q = ordered(4, [(0, 0), (0, 1), (0, 2)])
    q.put(handoff(0, 1))
    assert q.get(timeout=0.05) is None  # 0 has not come: 1 is held back
    q.put(handoff(0, 0))
    assert [q.get().batch.batch_index for _ in range(2)] == [0, 1]


def test_the_awaited_item_gets_into_a_full_queue():
    """Later items filling the queue must not lock out the one they wait for."""
    q = ordered(2, [(0, 0), (0, 1), (0, 2)])
    q.put(handoff(0, 1))
    q.put(handoff(0, 2))
    assert q.put(handoff(0, 0)) < 0.05 and q.depth() == 3
    assert [q.get().batch.batch_index for _ in range(3)] == [0, 1, 2]


def test_held_items_leave_once_every_producer_is_done():
    """The order only ever delays: a position that never comes holds nothing back at the end."""
    q = ordered(4, [(0, 0), (0, 1)], producers=1)
    q.put(handoff(0, 1))
    assert q.get(timeout=0.05) is None
    q.producer_done()
    assert q.get().batch.batch_index == 1 and q.exhausted()


def test_two_drifting_producers_reach_the_consumers_in_plan_order():
    """Target 0 makes the even batches, target 1 the odd ones at uneven speeds; two consumers
    take one item each per round (a step barrier between rounds): each round is a plan pair."""
    import random
    n = 40
    q = ordered(3, [(0, i) for i in range(n)])

    def produce(rank: int) -> None:
        rng = random.Random(rank)
        for i in range(rank, n, 2):
            time.sleep(rng.random() * (0.004 if rank else 0.001))
            q.put(handoff(0, i))
        q.producer_done()

    threads = [threading.Thread(target=produce, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    barrier, rounds = threading.Barrier(2), {0: [], 1: []}

    def consume(me: int) -> None:
        for _ in range(n // 2):
            item = None
            while item is None:
                item = q.get(timeout=1.0)
            rounds[me].append(item.batch.batch_index)
            barrier.wait(timeout=5)

    consumers = [threading.Thread(target=consume, args=(c,)) for c in (0, 1)]
    for t in consumers:
        t.start()
    for t in consumers + threads:
        t.join(timeout=10)
    pairs = [sorted(p) for p in zip(rounds[0], rounds[1])]
    assert pairs == [[2 * k, 2 * k + 1] for k in range(n // 2)]


def test_a_target_running_ahead_holds_no_more_than_its_share():
    """Target 0 runs ahead while the order waits for target 1's batch 1: target 0 may queue its
    share, ceil(4 / 2) = 2 batches (what the memory plan gives its GPU), and then waits."""
    stop = threading.Event()
    q = ordered(4, [(0, i) for i in range(8)], stop=stop)
    q.put(handoff(0, 0), producer=0)
    q.put(handoff(0, 2), producer=0)
    blocked = threading.Thread(target=lambda: q.put(handoff(0, 4), producer=0))
    blocked.start()
    blocked.join(timeout=0.3)
    assert blocked.is_alive() and q.depth() == 2
    assert q.get().batch.batch_index == 0  # a batch of target 0's leaves: room for its next
    blocked.join(timeout=2)
    assert not blocked.is_alive() and q.depth() == 2
    q.put(handoff(0, 1), producer=1)
    assert [q.get().batch.batch_index for _ in range(2)] == [1, 2]
    assert q.get(timeout=0.05) is None  # 4 waits for 3
