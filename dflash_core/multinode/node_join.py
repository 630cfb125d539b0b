"""Joining the other nodes: node 0's store, each node's join status, and what is said there
before the process group exists.

Joining posts each node's status in the store first (``join/K``), then makes the gloo group;
a node that ended before it joined posts that instead (``tell_join_failure``), so the others
fail at once naming it rather than at the timeout. The group is made once per process and kept
across restarts (torch.distributed initialises once per process). ``agree`` hands one value node
0 picked to the others through the same store, before any node joins.

``NodeJoin`` holds these methods of ``nodes.NodeGroup``, which is built on it and holds the state
they use (rank, world, host, the store, ``broken``) and the heartbeat the join starts.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from typing import Callable

from dflash_core.multinode.node_failure import NodeFailure

JOIN_POLL_S = 0.1  # the join looks at the other nodes' statuses this often
# A node that ended before joining and serves the store (node 0 outside torchrun's agent) waits
# at most this long for the others to come and read why, then exits.
JOIN_NOTICE_S = 60.0
ABORT_NOTICE_S = 3.0  # the same after an abort while joining (headless leaves within 5 s)


class NodeJoin:
    """The joining part of a ``nodes.NodeGroup``: the store, the join, and what a node says in the
    store before it has joined."""

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
