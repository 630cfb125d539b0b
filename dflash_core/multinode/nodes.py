"""Several nodes: one engine per node under torchrun, joined by torch.distributed.

torchrun starts one process per node and hands it ``RANK`` (the node number here),
``WORLD_SIZE`` (the nodes), ``LOCAL_RANK`` and ``MASTER_ADDR`` / ``MASTER_PORT`` (where node 0's
store listens). Outside torchrun (no ``WORLD_SIZE``, or 1) ``node_info`` is None and nothing of
this module runs.

Joining posts each node's status in the store first (``join/K``), then makes the gloo group;
a node that ended before it joined posts that instead (``tell_join_failure``), so the others
fail at once naming it rather than at the timeout. The group is made once per process and kept
across restarts (torch.distributed initialises once per process).

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

import datetime
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dflash_core.config import ConfigError

SLOT_BYTES = 64 * 1024  # one node's summary in the exchange (JSON), error text is trimmed to fit
BEAT_S = 0.5  # heartbeat period in the store
LOST_AFTER_S = 2.0  # a node whose counter has not moved for this long is taken as gone
POLL_S = 0.05
JOIN_POLL_S = 0.1  # the join looks at the other nodes' statuses this often
# A node that ended before joining and serves the store (node 0 outside torchrun's agent) waits
# at most this long for the others to come and read why, then exits.
JOIN_NOTICE_S = 60.0
ABORT_NOTICE_S = 3.0  # the same after an abort while joining (headless leaves within 5 s)


class NodeFailure(RuntimeError):
    """A collective across nodes failed: a node died, hung past the timeout, or left."""

    error_kind = "node"

    def __init__(self, message: str, nodes: list[int], hint: str = "", ending: str = "failed"):
        super().__init__(message)
        self.nodes = nodes
        self.ending = ending  # how the named node(s) ended: "aborted" when one stopped on request
        self.hint = hint or ("look at that node's train.log (runs/NAME/node-K/) and its console; "
                             "start all nodes again with --resume to go on from the last "
                             "checkpoint")


@dataclass(frozen=True)
class NodeInfo:
    rank: int  # this node's number, 0 = the node that writes checkpoints and W&B
    world: int  # nodes in the run
    local_world: int = 1  # processes torchrun started on this machine

    @property
    def lead(self) -> bool:
        return self.rank == 0


def node_info(environ=None) -> NodeInfo | None:
    """This process's place among the nodes, from torchrun's environment; None outside torchrun
    or with a single node (then nothing changes)."""
    env = os.environ if environ is None else environ
    try:
        world = int(env.get("WORLD_SIZE", "1") or "1")
    except ValueError:
        world = 1
    if world <= 1:
        return None
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ConfigError("", f"WORLD_SIZE is {world} but {', '.join(missing)} is not set",
                          hint="start every node with torchrun (it sets RANK, WORLD_SIZE, "
                               "MASTER_ADDR, MASTER_PORT), or unset WORLD_SIZE for one node")
    return NodeInfo(rank=int(env["RANK"]), world=world,
                    local_world=int(env.get("LOCAL_WORLD_SIZE", "1") or "1"))


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


def node_dir_name(rank: int) -> str:
    return f"node-{rank}"


class NodeGroup:
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

    def _open_store(self, timeout_s: float):
        """The store every node reaches at MASTER_ADDR:MASTER_PORT (keys of this launch only),
        and whether this process serves it. Opened once: node 0 may serve it only once."""
        if self._opened is None:
            self._opened = self._new_store(timeout_s)
        return self._opened

    def _new_store(self, timeout_s: float):
        import torch.distributed as dist

        env = os.environ
        # Under torchrun's own rendezvous the agent already serves the store on MASTER_PORT;
        # started without an agent, node 0's process serves it (as torch's env:// init does).
        serve = self.rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        # No wait for the other nodes here: the join below waits, and names who did not come.
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), None, is_master=serve,
                              timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        # An agent's store outlives an elastic restart of the workers: keys per attempt.
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"dflash/{attempt}", store), serve

    def _endpoint(self) -> str:
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"

    def connect(self, timeout_s: float, cuda: bool,
                waiting: Callable[[list[int]], None] | None = None,
                stopped: Callable[[], bool] | None = None) -> None:
        """Join the other nodes (waits for all of them, up to ``timeout_s``). Each node first
        posts its status in the store (``join/K``), so a node that failed before joining
        (``tell_join_failure``) fails the others at once, named, instead of after the timeout.
        ``waiting(nodes)``: called about once a second with the nodes not joined yet;
        ``stopped()``: this node was asked to stop (it posts that and raises NodeFailure with
        ending "aborted")."""
        import torch.distributed as dist

        if self.connected:
            return
        if self.broken:
            raise NodeFailure(f"the node group is unusable since {self.broken}", [],
                              hint="start all nodes again (with --resume to go on)")
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store, serve = self._open_store(timeout_s)
        except Exception as exc:  # noqa: BLE001 - a refused or timed-out connection, said plainly
            self.broken = f"joining failed: {exc}"
            raise NodeFailure(
                f"node {self.rank} could not reach node 0's store at {self._endpoint()} within "
                f"{timeout_s:.0f} s (nodes.timeout_s): {exc}", [0],
                hint="start every node with the same torchrun --nnodes and --rdzv-endpoint; "
                     "check that node 0 is running and reachable on that port") from exc
        try:
            store.set(f"join/{self.rank}", json.dumps({"host": self.host, "ending": ""}))
            self._await_joins(store, timeout_s, waiting, stopped, serve)
            dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=self.rank,
                                    world_size=self.world, timeout=timeout)
            if cuda and dist.is_nccl_available():
                self._nccl = dist.new_group(backend="nccl", timeout=timeout)
        except NodeFailure as exc:
            self.broken = f"joining failed: {exc}"
            raise
        except Exception as exc:  # noqa: BLE001 - a refused or timed-out join, said plainly
            self.broken = f"joining failed: {exc}"
            raise NodeFailure(
                f"node {self.rank} could not join the other {self.world - 1} node(s) at "
                f"{self._endpoint()} within {timeout_s:.0f} s: {exc}", [],
                hint="start every node with the same torchrun --nnodes and --rdzv-endpoint; "
                     "check that node 0 is reachable on that port") from exc
        self._store = dist.PrefixStore("beat", store)
        self._beat_thread = threading.Thread(target=self._beat, name="node-beat", daemon=True)
        self._beat_thread.start()

    def agree(self, key: str, pick: Callable[[], str], timeout_s: float, *,
              stopped: Callable[[], bool] | None = None,
              waiting: Callable[[], None] | None = None) -> str:
        """One value every node uses, decided by node 0 (``pick()``) and read by the others from
        the store, before any node joins: the run folder a fresh run takes (``--new-run``, the
        demo), which each node would otherwise pick on its own disk. ``waiting()``: called once
        when node 0 has not said it within a second; ``stopped()``: give up (ending "aborted")."""
        try:
            store, _ = self._open_store(timeout_s)
        except Exception as exc:  # noqa: BLE001 - a refused or timed-out connection, said plainly
            raise NodeFailure(
                f"node {self.rank} could not reach node 0's store at {self._endpoint()} within "
                f"{timeout_s:.0f} s (nodes.timeout_s) to learn its {key}: {exc}", [0],
                hint="start every node with the same torchrun --nnodes and --rdzv-endpoint; "
                     "check that node 0 is running and reachable on that port") from exc
        slot = f"agree/{key}"
        if self.rank == 0:
            value = pick()
            store.set(slot, value)
            return value
        t0 = time.monotonic()
        told = False
        while not store.check([slot]):
            if stopped is not None and stopped():
                raise NodeFailure(f"node {self.rank} stopped while waiting for node 0's {key}",
                                  [], ending="aborted")
            ended = self._joined(store).get(0, {})
            if ended.get("ending"):
                raise NodeFailure(
                    f"node 0 ({ended.get('host', '?')}) {ended['ending']} before it named the "
                    f"{key}: {ended.get('error') or 'no message'}", [0], ending=ended["ending"],
                    hint=(f"on node 0: {ended['hint']}" if ended.get("hint") else
                          "see node 0's console") + "; then start every node again")
            waited = time.monotonic() - t0
            if waited > timeout_s:
                raise NodeFailure(
                    f"node 0 did not name the {key} within {timeout_s:.0f} s (nodes.timeout_s)",
                    [0], hint="look at node 0's console: it may have failed early or not been "
                              "started; start every node with the same torchrun --nnodes and "
                              "--rdzv-endpoint")
            if waiting is not None and not told and waited >= 1.0:
                told = True
                waiting()
            time.sleep(JOIN_POLL_S)
        return store.get(slot).decode()

    def _joined(self, store) -> dict[int, dict]:
        """The join statuses posted so far, by node."""
        out = {}
        for k in range(self.world):
            if store.check([f"join/{k}"]):
                out[k] = json.loads(store.get(f"join/{k}").decode())
        return out

    def _await_joins(self, store, timeout_s: float, waiting: Callable[[list[int]], None] | None,
                     stopped: Callable[[], bool] | None, serve: bool) -> None:
        t0 = last = time.monotonic()
        while True:
            if stopped is not None and stopped():
                store.set(f"join/{self.rank}", json.dumps({
                    "host": self.host, "ending": "aborted", "error": "stopped while joining"}))
                if serve:  # an abort ends the process within seconds: linger briefly only
                    self._linger(store, ABORT_NOTICE_S)
                raise NodeFailure(f"node {self.rank} stopped while joining; the other nodes "
                                  "are told", [], ending="aborted")
            joined = self._joined(store)
            ended = {k: v for k, v in joined.items() if v.get("ending")}
            if ended:
                k, v = next(iter(ended.items()))
                raise NodeFailure(
                    f"node {k} ({v.get('host', '?')}) {v['ending']} before joining: "
                    f"{v.get('error') or 'no message'}", [k], ending=v["ending"],
                    hint=(f"on node {k}: {v['hint']}" if v.get("hint") else
                          f"see node {k}'s console") + "; then start every node again")
            missing = [k for k in range(self.world) if k not in joined]
            if not missing:
                return
            now = time.monotonic()
            if now - t0 > timeout_s:
                names = ", ".join(f"node {k}" for k in missing)
                raise NodeFailure(
                    f"{names} did not join within {timeout_s:.0f} s (nodes.timeout_s): "
                    f"{'it' if len(missing) == 1 else 'they'} never reached node 0's store at "
                    f"{self._endpoint()}", missing,
                    hint=f"look at the console of {names}: it may have failed before it could "
                         f"join, not been started, or not reach {self._endpoint()}; start every "
                         "node with the same torchrun --nnodes and --rdzv-endpoint")
            if waiting is not None and now - last >= 1.0:
                last = now
                waiting(missing)
            time.sleep(JOIN_POLL_S)

    def tell_join_failure(self, ending: str, message: str, hint: str = "",
                          wait_s: float = JOIN_NOTICE_S,
                          say: Callable[[str], None] | None = None) -> None:
        """This node's run ended (``ending``: failed, aborted) before it joined: post that where
        the others wait to join, so they stop at once naming this node. Node 0, when it serves
        the store, keeps serving until the others have come (at most ``wait_s``) so they read
        it. Best effort: a node that cannot reach the store leaves the others to time out."""
        if self.connected or self.broken:
            return
        self.broken = f"this node {ending} before joining"
        if say is not None:  # it may take a while: the store's host, or the others, not up yet
            say(f"telling the other nodes this node {ending}, through {self._endpoint()} (up to "
                f"{wait_s:.0f} s)")
        try:
            store, serve = self._open_store(wait_s)
            store.set(f"join/{self.rank}", json.dumps({
                "host": self.host, "ending": ending, "error": message[:2000], "hint": hint}))
            if serve:
                self._linger(store, wait_s)
        except Exception:  # noqa: BLE001 - nobody to tell: the others' timeout names this node
            pass

    def _linger(self, store, wait_s: float) -> None:
        """Node 0 serving the store: keep it up until every node posted its status (so each
        polls again and reads this one's), at most ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while len(self._joined(store)) < self.world and time.monotonic() < deadline:
            time.sleep(JOIN_POLL_S)
        time.sleep(4 * JOIN_POLL_S)  # their next poll reads this node's status

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
