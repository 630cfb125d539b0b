"""One run's side of the multi-node protocol: what a node says and decides at each step boundary.

Every node's stepping thread (the last drafter to reach the barrier) calls ``boundary`` before
the optimizer step. All nodes exchange one small summary each (nodes.NodeGroup.exchange) and then
decide the same thing from the same data:

- a node that ended (its farewell: failed, aborted) ends the run everywhere: a failure is this
  node's failure too, named after that node, and node 0 still writes its checkpoint (its weights
  are those of the last step every node took);
- an abort or restart pressed on any node stops every node after this exchange (restart: each
  node then resumes from the checkpoint node 0 just wrote);
- no node has gradients: the run is over when every node's data is used up;
- at the first exchange the planned steps and resumed step must agree, and every
  ``nodes.checksum_every`` steps the drafter weights' checksums must be equal.

Otherwise every node takes the step (its gradients summed across nodes by ``across``) and records
the batches the others trained, so node 0's checkpoint holds the data position of the whole run.

A node whose run ends before the others hear of it (a failure, an abort before the first step)
sends its summary once more, marked with how it ended (``farewell``): the others, waiting at
their step boundary, get it there. After an exchange that ended the run nobody exchanges again,
so every node makes the same number of collectives.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from dflash_core.config import NodesConfig
from dflash_core.observe.events import Error, Log, NodeStatus
from dflash_core.multinode.node_failure import NodeFailure
from dflash_core.multinode.node_join import JOIN_NOTICE_S
from dflash_core.multinode.nodes import NodeGroup
from dflash_core.models.training.trainer import RateMeter

if TYPE_CHECKING:  # the run's parts, named for the reader only: the link never builds them
    from dflash_core.data import Prefetcher
    from dflash_core.models.training.replica import DrafterReplica
    from dflash_core.observe.watchdog import Heartbeats
    from dflash_core.checkpoint.save_load import LoadedCheckpoint
    from dflash_core.checkpoint.data_position import DataPosition

STATUS_EVERY_S = 1.0  # NodeStatus per node at most this often (a change of ending / error: always)
ERROR_CHARS = 2000  # of a node's last error message in its summary


def _waiting_for(nodes: list[int]) -> str:
    return f"waiting for {', '.join(f'node {k}' for k in nodes) or 'the other nodes'}"


class QueueGauge(Protocol):
    """What the link reads of the run's hidden-state queue (pipeline/hs_queue.py's)."""

    capacity: int

    def depth(self) -> int: ...

    def exhausted(self) -> bool: ...


class LinkedRun(Protocol):
    """What the link may see of the run it serves (pipeline/run.py's ``Run`` is one).

    It reads the rest to build its summary and sets only three things: ``abort_requested`` (an
    abort or restart from another node), ``peer_failed`` (the run fails because another node
    did, so node 0 still writes its checkpoint) and ``stop`` (every node ends the run together).
    """

    step: int
    replicas: list[DrafterReplica]
    target_devices: list[torch.device]
    drafter_devices: list[torch.device]
    hs_queue: QueueGauge | None
    prefetchers: list[Prefetcher]
    position: DataPosition | None
    resume: LoadedCheckpoint | None
    failure: Error | None
    heartbeats: Heartbeats
    abort_requested: bool
    peer_failed: bool
    stop: threading.Event

    @property
    def total_steps(self) -> int: ...


class NodeMismatch(RuntimeError):
    """The nodes disagree on something they must share: no checkpoint is written after it."""

    error_kind = "node"

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


@dataclass
class Verdict:
    stop: bool = False  # the run ends now on every node
    any_work: bool = True  # some node has gradients for this step
    all_exhausted: bool = False  # every node's data is used up


def weights_checksum(params: list[torch.Tensor]) -> float:
    """A cheap fingerprint of the drafter weights: position-weighted sums in float64, so equal
    weights give bit-equal values on every node and a swapped or drifted tensor does not."""
    if not params:
        return 0.0
    total = torch.zeros((), dtype=torch.float64, device=params[0].device)
    with torch.no_grad():
        for i, p in enumerate(params):
            x = p.detach().double()
            total += x.sum() * (i + 1) + x.square().sum()
    return float(total)


class _Across:
    """What the trainer calls once per step to sum its gradient buffer across nodes."""

    def __init__(self, link: NodeLink, run: LinkedRun):
        self.link, self.run = link, run

    def all_reduce_(self, buf: torch.Tensor) -> None:
        self.run.heartbeats.beat("gradient all-reduce across nodes")
        if buf.is_cuda:  # time the transfer, not the kernels queued before it (the clip syncs next)
            torch.cuda.synchronize(buf.device)
        t = time.monotonic()
        try:
            self.link.group.all_reduce_(buf)
            if buf.is_cuda:
                torch.cuda.synchronize(buf.device)
        except NodeFailure:
            self.run.peer_failed = True
            self.link.over = True
            raise
        self.link.reduce_s = time.monotonic() - t


class NodeLink:
    """One run's side of the protocol, made for that run (``run``) from the config it serves."""

    def __init__(self, run: LinkedRun, group: NodeGroup, publish: Callable[[Any], None], *,
                 fail: Callable[[Error], None], restart: Callable[[], None],
                 restarting: Callable[[], bool], checksum_every: int, stall_s: float,
                 timeout_s: float):
        self.run, self.group, self.publish = run, group, publish
        self.rank, self.world = group.rank, group.world
        self._fail, self._restart, self._restarting = fail, restart, restarting
        self.checksum_every, self.stall_s, self.timeout_s = checksum_every, stall_s, timeout_s
        self.exchanges = 0
        self.over = False  # an exchange ended the run: no more collectives in it
        self.remote: list = []  # batches the other nodes train in this step
        self.rate = RateMeter()
        self.local_sps = self.local_tps = 0.0
        self.reduce_s = 0.0  # the last gradient all-reduce, seconds
        self.last_error = ""
        self._status_t: dict[int, tuple[float, str, str]] = {}

    @classmethod
    def from_config(cls, nodes: NodesConfig, stall_s: float, run: LinkedRun, group: NodeGroup,
                    publish: Callable[[Any], None], *, fail: Callable[[Error], None],
                    restart: Callable[[], None], restarting: Callable[[], bool]) -> NodeLink:
        """The link of a run whose config has ``nodes`` (nodes.*) and the stall floor ``stall_s``
        (telemetry.stall_floor_s: how long a collective waits before it says whom it waits
        for)."""
        return cls(run, group, publish, fail=fail, restart=restart, restarting=restarting,
                   checksum_every=nodes.checksum_every, stall_s=stall_s,
                   timeout_s=nodes.timeout_s)

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @property
    def live(self) -> bool:
        """Steps are being exchanged: an abort now waits for the next step boundary."""
        return self.exchanges > 0 and not self.over

    def across(self) -> _Across:
        return _Across(self, self.run)

    def note_error(self, ev) -> None:
        """A bus tap: this node's last error, for its summary."""
        if isinstance(ev, Error) and not ev.source.startswith("node-"):
            self.last_error = f"{ev.source}: {ev.message}"

    # -- the summary ---------------------------------------------------------------------------
    def _summary(self, *, ending: str = "", checksum: bool = False) -> dict:
        run = self.run
        reps = run.replicas
        samples = sum(r.micro.samples for r in reps)
        tokens = sum(r.micro.tokens for r in reps)
        if not ending and reps:
            self.local_tps, self.local_sps = self.rate.add(tokens, samples)
        devices = {d for d in run.target_devices + run.drafter_devices if d.type == "cuda"}
        q = run.hs_queue
        return {
            "node": self.rank, "host": self.group.host, "step": run.step,
            "total_steps": run.total_steps, "resumed": run.resume.step if run.resume else 0,
            "ending": ending, "error": self.last_error[:ERROR_CHARS],
            "abort": bool(run.abort_requested),
            "restart": bool(run.abort_requested and self._restarting()),
            "work": any(r.micro.samples for r in reps),  # a batch since the last step
            "exhausted": bool(q.exhausted()) if q is not None else False,
            "sps": self.local_sps, "tps": self.local_tps, "reduce_s": self.reduce_s,
            "hs": [q.depth(), q.capacity] if q is not None else [0, 0],
            "prefetch": [[p.depth(), p.capacity] for p in run.prefetchers],
            "gpu_mem": [torch.cuda.memory_allocated(d) for d in sorted(devices, key=str)],
            "batches": run.position.pending_batches() if run.position is not None else [],
            "checksum": weights_checksum(reps[0].params()) if checksum and reps else None,
        }

    def _publish_status(self, views: list[dict]) -> None:
        now = time.monotonic()
        for v in views:
            k = v["node"]
            last = self._status_t.get(k)
            if last and now - last[0] < STATUS_EVERY_S and (last[1], last[2]) == (v["ending"],
                                                                                    v["error"]):
                continue
            self._status_t[k] = (now, v["ending"], v["error"])
            self.publish(NodeStatus(
                node=k, host=v["host"], step=v["step"], samples_per_s=v["sps"],
                tokens_per_s=v["tps"], hs_depth=v["hs"][0], hs_capacity=v["hs"][1],
                prefetch=v["prefetch"], gpu_mem=v["gpu_mem"], allreduce_s=v["reduce_s"],
                ending=v["ending"],
                error=v["error"]))

    def _exchange(self, payload: dict, where: str) -> list[dict]:
        run = self.run
        warned = [False]
        noted = [False]

        def waiting(seconds: float) -> None:
            # Which nodes this one waits on: for the watchdog's Stall report (soon, so it is
            # there when the stall is reported) and, past the stall floor, a warning.
            if seconds > min(1.0, self.stall_s / 2) and not noted[0]:
                noted[0] = True
                run.heartbeats.note(_waiting_for(self.group.behind()))
            if seconds > self.stall_s and not warned[0]:
                warned[0] = True
                behind = self.group.behind()
                run.heartbeats.note(_waiting_for(behind))
                self.publish(Log(level="warning", source="nodes", message=(
                    f"{where}: waiting {seconds:.0f} s for "
                    f"{', '.join(f'node {k}' for k in behind) or 'the other nodes'} (in a "
                    f"collective; this node gives up after nodes.timeout_s "
                    f"{self.group.timeout_s:.0f} s)")))
        try:
            views = self.group.exchange(payload, waiting=waiting)
        except NodeFailure:
            run.peer_failed = True
            self.over = True
            raise
        self._publish_status(views)
        return views

    # -- at the start of a run -----------------------------------------------------------------
    def start(self) -> None:
        """Every node's run begins here together, before it reads a checkpoint: after a restart
        node 0 arrives only once its teardown wrote the checkpoint the others resume from. A
        node whose run ended before this (its farewell) ends the others' here."""
        self.run.heartbeats.beat("waiting for the other nodes to start the run")
        views = self._exchange(self._summary(), "at the start of the run")
        ended = [v for v in views if v["ending"] and v["node"] != self.rank]
        if ended:
            self.over = True
            self._peer_ended(ended)

    # -- at the step boundary ------------------------------------------------------------------
    def boundary(self) -> Verdict:
        """Called by the stepping thread before the optimizer step; the same verdict on every
        node."""
        run = self.run
        run.heartbeats.beat("step exchange with the other nodes")
        first = self.exchanges == 0
        check = first or bool(self.checksum_every and run.step % self.checksum_every == 0)
        views = self._exchange(self._summary(checksum=check),
                               f"step {run.step + 1} at the step boundary")
        self.exchanges += 1
        ended = [v for v in views if v["ending"] and v["node"] != self.rank]
        if ended:
            self.over = True
            self._peer_ended(ended)
            return Verdict(stop=True)
        if first:
            self._check_same(views, "total_steps", "plans {} optimizer steps",
                             "every node needs the same config.yaml and the same data "
                             "(data.path, run.seed, optim.*): copy node 0's config and data")
            self._check_same(views, "resumed", "resumed from step {}",
                             "a resume reads runs/NAME/checkpoints on every node: put "
                             "run.output_dir on a filesystem all nodes share (or copy node 0's "
                             "checkpoints to every node), or start every node without --resume")
        if check:
            sums = {v["node"]: v["checksum"] for v in views}
            if len(set(sums.values())) > 1:
                self.over = True
                listed = ", ".join(f"node {k} {s!r}" for k, s in sums.items())
                raise NodeMismatch(
                    f"the drafter weights differ across nodes at step {run.step}: checksums "
                    f"{listed}", hint="a node trained on other weights (another drafter."
                    "init_from, another PyTorch build, or a lost update); restart every node "
                    "with --resume from the last checkpoint")
        if any(v["abort"] or v["restart"] for v in views):
            self.over = True
            restart = any(v["restart"] for v in views)
            who = [v["node"] for v in views if v["abort"] or v["restart"]]
            self.publish(Log(level="info", source="nodes", message=(
                f"{'restart' if restart else 'abort'} from node {who[0]}: every node stops "
                f"after step {run.step}")))
            self._stop_here(restart)
            return Verdict(stop=True)
        self.remote = [b for v in views if v["node"] != self.rank for b in v["batches"]]
        return Verdict(any_work=any(v["work"] for v in views),
                       all_exhausted=all(v["exhausted"] for v in views))

    def _check_same(self, views: list[dict], key: str, what: str, hint: str) -> None:
        values = {v["node"]: v[key] for v in views}
        if len(set(values.values())) > 1:
            self.over = True
            listed = "; ".join(f"node {k} " + what.format(x) for k, x in values.items())
            raise NodeMismatch(f"the nodes disagree: {listed}", hint=hint)

    def _stop_here(self, restart: bool) -> None:
        self.run.abort_requested = True
        self.run.stop.set()
        if restart and not self._restarting():
            self._restart()  # the node that asked has its own restart going already

    def _peer_ended(self, ended: list[dict]) -> None:
        failed = [v for v in ended if v["ending"] == "failed"]
        if not failed:
            self.publish(Log(level="info", source="nodes", message=(
                f"node {ended[0]['node']} ended ({ended[0]['ending']}): every node stops")))
            self._stop_here(any(v["restart"] for v in ended))
            return
        v = failed[0]
        self.run.peer_failed = True
        self._fail(Error(
            error_kind="node", source=f"node-{v['node']}", phase="training",
            message=f"node {v['node']} ({v['host']}) failed: {v['error'] or 'no message'}",
            hint=f"node {v['node']}'s train.log (runs/NAME/node-{v['node']}/) has the traceback; "
                 "fix it and start every node again with --resume"))

    def after_step(self) -> None:
        """The step was taken on every node: the others' batches are trained too."""
        self.run.position.mark_done(self.remote)
        self.remote = []

    # -- the end of a run ----------------------------------------------------------------------
    def farewell(self, status: str) -> None:
        """Tell the others this node's run ended, unless an exchange already ended it for all.
        Waits for them at their step boundary (at most nodes.timeout_s). Before this node
        joined: posts how it ended where the others wait to join."""
        if self.over or self.group.broken:
            return
        self.over = True
        run = self.run
        if run.failure is not None and not self.last_error:
            self.last_error = f"{run.failure.source}: {run.failure.message}"
        if not self.group.connected:
            hint = run.failure.hint if run.failure is not None else ""
            self.group.tell_join_failure(
                status, self.last_error or status, hint=hint,
                wait_s=min(self.timeout_s, JOIN_NOTICE_S),
                say=lambda text: self.publish(Log(level="info", source="nodes", message=text)))
            return
        try:
            self.group.exchange(self._summary(ending=status), blocking=False)
        except NodeFailure as exc:
            self.publish(Log(level="warning", source="nodes", message=(
                f"could not tell the other nodes this run ended ({status}): {exc}")))
