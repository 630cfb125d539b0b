"""Several nodes: one engine per node under torchrun, joined by torch.distributed.

The process group of one node's process: its heartbeats and its collectives. Where this process
stands among the nodes (torchrun's environment) is node_place.py; joining the others,
node_join.py; the error every part raises, node_failure.py.

The group carries three things, all through torch.distributed on the port torchrun already uses:

- the control exchange at the start of each run and at every step boundary (gloo, CPU: each
  node's small JSON summary);
- the sum of the gradient buffer across nodes (NCCL for CUDA tensors, gloo for CPU ones);
- a heartbeat counter per node in the store, so that when a collective fails the node that
  stopped beating is named rather than guessed.

Every collective has a timeout (``nodes.timeout_s``); a failure becomes ``NodeFailure`` naming
the node(s) that are gone (heartbeat stopped) or, when every process still beats, those that
never reached the collective (stuck).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from typing import Callable

import torch

from dflash_core.config import ConfigError
from dflash_core.multinode.node_failure import NodeFailure
from dflash_core.multinode.node_join import JOIN_NOTICE_S, NodeJoin
from dflash_core.multinode.node_place import NodeInfo, node_info

SLOT_BYTES = 64 * 1024  # one node's summary in the exchange (JSON), error text is trimmed to fit
BEAT_S = 0.5  # heartbeat period in the store
LOST_AFTER_S = 2.0  # a node whose counter has not moved for this long is taken as gone
POLL_S = 0.05


def tell_failure_before_joining(message: str, hint: str = "") -> None:
    """Under torchrun with several nodes, a process that fails before its engine exists (a
    config it cannot load) still tells the others, which wait to join, why; else nothing."""
    try:
        info = node_info()
    except ConfigError:
        return  # no place to tell it: the others' timeout names this node
    if info is not None:
        NodeGroup(info).tell_join_failure("failed", message, hint, wait_s=JOIN_NOTICE_S,
                                          say=lambda text: print(text, file=sys.stderr))


class NodeGroup(NodeJoin):
    """The process group of one node's process, made once (``connect``) and kept across runs:
    torch.distributed can only be initialised once per process."""

    def __init__(self, info: NodeInfo):
        self.info = info
        self.rank, self.world = info.rank, info.world
        self.host = socket.gethostname()
        self.timeout_s = 0.0
        self._store = None
        self._opened = None  # (store, whether this process serves it): opened once per process
        self._nccl = None
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one collective at a time from this process
        self.broken = ""  # why the group can no longer be used ("" while it can)
        self._seq = 0  # collectives entered by this process (the same count on every node)

    @property
    def connected(self) -> bool:
        return self._store is not None
    # -- heartbeats ----------------------------------------------------------------------------
    def _beat(self) -> None:
        n = 0
        while not self._beat_stop.wait(BEAT_S):
            n += 1
            try:
                self._store.set(f"beat/{self.rank}", str(n))
            except Exception:  # noqa: BLE001 - the store's host is gone: lost_nodes says so
                return

    def _counters(self) -> dict[int, str | None]:
        out: dict[int, str | None] = {}
        for k in range(self.world):
            if k == self.rank:
                continue
            try:
                out[k] = self._store.get(f"beat/{k}").decode() if self._store.check(
                    [f"beat/{k}"]) else ""
            except Exception:  # noqa: BLE001
                out[k] = None  # the store itself is unreachable
        return out

    def lost_nodes(self) -> tuple[list[int], str]:
        """After a failed collective: the other nodes whose heartbeat stopped, and why we think
        so. Takes about LOST_AFTER_S."""
        first = self._counters()
        if any(v is None for v in first.values()):
            return [0], "the store node 0 serves is unreachable"
        time.sleep(LOST_AFTER_S)
        second = self._counters()
        if any(v is None for v in second.values()):
            return [0], "the store node 0 serves is unreachable"
        gone = [k for k in first if first[k] == second[k]]
        return gone, "its heartbeat stopped" if gone else "every heartbeat goes on"

    # -- collectives ---------------------------------------------------------------------------
    def _failed(self, what: str, exc: BaseException) -> NodeFailure:
        gone, why = self.lost_nodes() if self._store is not None else ([], "")
        self.broken = f"{what} failed"
        names = ", ".join(f"node {k}" for k in gone)
        if gone:
            message = f"{names} {'is' if len(gone) == 1 else 'are'} gone ({why}): {what} failed: {exc}"
            return NodeFailure(message, gone)
        # Every process still beats: a node is alive but stuck before this collective.
        late = self.behind() if self._store is not None else []
        if late:
            names = ", ".join(f"node {k}" for k in late)
            return NodeFailure(
                f"{names} did not reach {what} within {self.timeout_s:.0f} s (nodes.timeout_s); "
                f"its process is alive (heartbeat goes on) but stuck: {exc}", late,
                hint=f"the Stall events and train.log of {names} (runs/NAME/node-K/) say where it "
                     "is stuck; raise nodes.timeout_s if that node was only slow (a long "
                     "checkpoint or evaluation); start all nodes again with --resume")
        return NodeFailure(f"{what} failed after {self.timeout_s:.0f} s (nodes.timeout_s) with no "
                           f"node gone: one is stuck: {exc}", [])

    def _arrive(self) -> None:
        """Count this collective (every node makes the same ones, in the same order) where the
        others can see it: behind() names the nodes that have not got as far."""
        self._seq += 1
        try:
            self._store.set(f"at/{self.rank}", str(self._seq))
        except Exception:  # noqa: BLE001 - only feeds behind(); the collective says more
            pass

    def behind(self) -> list[int]:
        """The other nodes that have not reached the collective this node waits in."""
        late = []
        for k in range(self.world):
            try:
                at = int(self._store.get(f"at/{k}").decode()) if self._store.check(
                    [f"at/{k}"]) else 0
            except Exception:  # noqa: BLE001
                at = 0
            if k != self.rank and at < self._seq:
                late.append(k)
        return late

    def exchange(self, payload: dict, *, waiting: Callable[[float], None] | None = None,
                 blocking: bool = True) -> list[dict]:
        """Every node's ``payload`` (JSON-able, small), in node order. ``waiting(seconds)`` is
        called while the other nodes have not all arrived yet. ``blocking=False``: give up at
        once if another collective of this process is in flight (the run's last word, which
        must not queue behind a stuck one)."""
        import torch.distributed as dist

        data = json.dumps(payload, separators=(",", ":")).encode()
        if len(data) > SLOT_BYTES - 4:
            raise ValueError(f"node summary of {len(data)} bytes exceeds {SLOT_BYTES - 4}")
        mine = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
        mine[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
        mine[4:4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        slots = [torch.empty_like(mine) for _ in range(self.world)]
        if not self._lock.acquire(blocking=blocking):
            raise NodeFailure("another collective of this node is still in flight", [])
        try:
            self._check_usable()
            self._arrive()
            t0 = time.monotonic()
            try:
                work = dist.all_gather(slots, mine, async_op=True)
                while not work.is_completed():
                    time.sleep(POLL_S)
                    if waiting is not None:
                        waiting(time.monotonic() - t0)
                work.wait()
            except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError on a lost peer
                raise self._failed("the step-boundary exchange", exc) from exc
        finally:
            self._lock.release()
        out = []
        for s in slots:
            raw = s.numpy().tobytes()
            n = int.from_bytes(raw[:4], "little")
            out.append(json.loads(raw[4:4 + n].decode()))
        return out

    def all_reduce_(self, buf: torch.Tensor) -> None:
        """Sum ``buf`` elementwise across the nodes, in place (the trainer's ``across``)."""
        import torch.distributed as dist

        with self._lock:
            self._check_usable()
            group = self._nccl if buf.is_cuda else None
            if buf.is_cuda and group is None:
                raise NodeFailure("a CUDA gradient buffer but no NCCL group", [],
                                  hint="this build of PyTorch has no NCCL")
            self._arrive()
            try:
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
            except Exception as exc:  # noqa: BLE001
                raise self._failed("the gradient all-reduce", exc) from exc

    def _check_usable(self) -> None:
        if self.broken:
            raise NodeFailure(f"the node group is unusable since {self.broken}", [])
        if not self.connected:
            raise NodeFailure("the node group is not connected", [])

    def close(self) -> None:
        """Leave the group (end of the process)."""
        import torch.distributed as dist

        self._beat_stop.set()
        if self._beat_thread is not None:
            self._beat_thread.join(2 * BEAT_S)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may refuse; the process ends anyway
                pass
        self._store = None
        self._opened = None  # node 0's store server ends with its last reference
