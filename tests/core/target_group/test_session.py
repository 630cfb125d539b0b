"""A group session's reply read: a queue that breaks (a rank ended while handing over a tensor's
file descriptor) is a rank failure naming the rank, not an OSError out of the verb."""

import queue
from types import SimpleNamespace

import pytest

from dflash_core.target_group.group import GroupRankFailed
from dflash_core.target_group.session import GroupSession


class _Broken:
    def get(self, timeout=None):
        raise ConnectionResetError(104, "Connection reset by peer")

    def get_nowait(self):
        raise queue.Empty


def _session(dead):
    """A session whose group sees ``dead`` only after the read has begun (as a rank dying
    mid-handover is seen)."""
    seen = iter([None])
    s = object.__new__(GroupSession)
    s.group = SimpleNamespace(dead_rank=lambda besides=None: next(seen, dead),
                              split=SimpleNamespace(k=2), replies=[_Broken(), _Broken()])
    return s


def test_a_broken_reply_queue_names_the_rank_that_died():
    died = GroupRankFailed("target group 0 rank 1 (cpu) was killed by SIGKILL")
    with pytest.raises(GroupRankFailed, match="rank 1 .* SIGKILL"):
        _session(died)._reply(1)


def test_a_broken_reply_queue_with_every_rank_alive_is_still_a_rank_failure():
    with pytest.raises(GroupRankFailed, match="rank 1: its reply queue broke"):
        _session(None)._reply(1)
