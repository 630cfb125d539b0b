"""Everything one run owns, made whole when the run starts and dropped whole when it ends (so a
restart can never see the last run's state): its worker threads, each guarded (an exception
fails the run, never the process), and what the run does at each optimizer step: reduce and
step, report, then call its checkpointer (checkpoint/checkpointer.py: one call, it decides what
is due) and its evaluator (evaluation.py) when it is due."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dflash_core.config import Config
from dflash_core.data import Prefetcher
from dflash_core.models.target.load import LoadAborted
from dflash_core.models.training.replica import DrafterReplica
from dflash_core.models.training.trainer import RateMeter, reduce_and_step
from dflash_core.pipeline.step_barrier import StepBarrier
from dflash_core.multinode.node_link import NodeLink
from dflash_core.observe.device_hours import RECORD_KEY
from dflash_core.observe.errors import error_event
from dflash_core.observe.events import (
    WORKER_FAILED, WORKER_STOPPED, Error, Log, StepMetrics, WorkerStatus,
)
from dflash_core.observe.sinks.run_sinks import RunSinks
from dflash_core.observe.watchdog import Heartbeats
from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.data_identity import of_dataset
from dflash_core.checkpoint.data_position import DataPosition
from dflash_core.persist.hours_ledger import write_held
from dflash_core.checkpoint.checkpointer import Checkpointer
from dflash_core.pipeline.evaluation import Evaluator
from dflash_core.pipeline.hours_meter import HoursMeter
from dflash_core.pipeline.hs_queue import HiddenStateQueue
from dflash_core.pipeline.lifecycle import Lifecycle
from dflash_core.pipeline.target_stage import TargetStage
from dflash_core.pipeline.workers import Stopped, UpstreamFailed
from dflash_core.planning.layout_advice import LayoutAdvisor
from dflash_core.planning.preflight import Prepared
from dflash_core.target_group.group import GroupRankFailed
from dflash_core.target_group.remote import GroupClosed


@dataclass
class Run:
    publish: Callable[[Any], None]  # the engine's bus, given once
    lifecycle: Lifecycle  # the engine's state, which the first step moves to training
    stop: threading.Event = field(default_factory=threading.Event)
    abort_requested: bool = False
    failure: Error | None = None
    finished: bool = False
    started_at: float = field(default_factory=time.monotonic)
    heartbeats: Heartbeats = field(default_factory=Heartbeats)  # read by the stall watchdog
    # Events published before the run folder (and so its sinks) exist; None once handed over.
    early: list | None = field(default_factory=list)

    # preflight
    config: Config | None = None
    sinks: RunSinks | None = None
    target_devices: list[torch.device] = field(default_factory=list)
    groups: list = field(default_factory=list)  # target groups' rank processes (target_group/)
    drafter_devices: list[torch.device] = field(default_factory=list)
    prep: Prepared | None = None
    resume: ckpt.LoadedCheckpoint | None = None
    hours: HoursMeter | None = None  # the device time it holds, from its announcement on
    # device_hours.json is written only from when the resume is settled: an attempt refused
    # before (preflight, a resume on other data or optimizer) changes nothing in the run folder
    # but its events.jsonl and train.log (its time is in its DeviceHours events).
    ledger_open: bool = False

    # loading and training
    threads: list[threading.Thread] = field(default_factory=list)
    prefetchers: list[Prefetcher] = field(default_factory=list)
    targets: list[TargetStage] = field(default_factory=list)
    hs_queue: HiddenStateQueue | None = None
    position: DataPosition | None = None
    replicas: list[DrafterReplica] = field(default_factory=list)
    barrier: StepBarrier | None = None
    checkpointer: Checkpointer | None = None  # from warm-up on
    evaluator: Evaluator | None = None  # from warm-up on
    rate: RateMeter = field(default_factory=RateMeter)
    step: int = 0
    last_step_t: float = field(default_factory=time.monotonic)
    advisor: LayoutAdvisor | None = None  # a bus tap while the run trains
    # Several nodes (None on one node): made from the run's config once it is read; it reads
    # and sets this run only as node_link.LinkedRun says. peer_failed: the run failed because
    # another node did; this node's weights are those of the last step all took, so node 0
    # still writes its checkpoint.
    link: NodeLink | None = None
    peer_failed: bool = False
    resume_t0: float | None = None  # when --resume began reading, until the first step
    _data_id: dict | None = None
    _group_eval: Any = None  # the first target group as the evaluation's target (evaluate)
    _ledger_failed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def total_steps(self) -> int:
        return self.prep.total_steps if self.prep is not None else 0

    @property
    def writes_records(self) -> bool:
        """Checkpoints and evaluations: on one node, or on node 0 of several."""
        return self.link is None or self.link.lead

    def finish(self) -> None:
        self.finished = True
        self.stop.set()

    def note_failure(self, ev: Error) -> bool:
        """Stop the run for ``ev``; True when it is the run's first (its failure)."""
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = ev
            self.stop.set()
        return first

    def fail(self, ev: Error) -> None:
        """The run fails with ``ev`` and stops. Only the first failure is fatal; those after it
        (usually its consequences) are published as not fatal."""
        first = self.note_failure(ev)
        self.publish(ev if first else Error(**{**ev.__dict__, "fatal": False}))

    # -- its worker threads --------------------------------------------------------------------
    def start_worker(self, name: str, role: str, device: str, fn) -> threading.Thread:
        """Run a worker body on a thread of the run's, guarded (``_guard``)."""
        t = threading.Thread(target=self._guard, args=(name, role, device, fn),
                             name=name, daemon=True)
        self.threads.append(t)
        t.start()
        return t

    def _guard(self, source: str, role: str, device: str, fn) -> None:
        """Run a worker body; turn its exception into an Error event and a failed run. A target
        or drafter publishes its last state here, whichever way its body ends: what the body
        returns (a target's "done" when its data ran out), else stopped or failed."""
        self.heartbeats.beat("starting")  # from now on the watchdog watches this thread
        last, detail = None, ""
        try:
            last = fn()
            stopped = True
        except Stopped:
            stopped = True
        except UpstreamFailed as up:
            stopped, detail = True, f"{up.source} failed"  # the Error names the one that did
            self.fail(error_event(up.cause, source=up.source, role=up.role,
                                  device=up.device or device, phase=self.lifecycle.state))
        except BaseException as exc:  # noqa: BLE001 - every failure must surface
            stopped = isinstance(exc, LoadAborted) and self.stop.is_set()
            if not stopped:
                self.fail(error_event(exc, source=source, role=role, device=device,
                                      phase=self.lifecycle.state))
                self.publish(WorkerStatus(worker=source, role=role, device=device,
                                          status=WORKER_FAILED, detail=str(exc)[:200]))
        if stopped and role in ("target", "drafter"):
            self.publish(WorkerStatus(worker=source, role=role, device=device,
                                      status=last or WORKER_STOPPED, detail=detail))

    # -- its device time (hours_meter.py) --------------------------------------------------------
    def publish_hours(self, reason: str = "periodic") -> None:
        """The device time held so far as a DeviceHours event; the records' writer also keeps
        the run folder's total (persist/hours_ledger.py)."""
        meter = self.hours
        if meter is None:
            return
        e = meter.event(self.step, reason)
        self.publish(e)
        if (not self.writes_records or self.config is None or self._ledger_failed
                or not self.ledger_open):
            return
        try:  # what the run folder's segments held: this figure and what it leaves out
            write_held(self.config.run_dir, e.gpu_hours + e.lost_gpu, e.host_hours + e.lost_host,
                       step=self.step)
        except OSError as exc:  # the figures still go to the events and the checkpoints
            self._ledger_failed = True
            self.publish(Log(level="warning", source="engine", message=(
                f"device time: cannot write {self.config.run_dir}/device_hours.json ({exc}); "
                "the checkpoints and events still record it, but the time a crash loses after "
                "the last checkpoint will not be known")))

    def hours_tick(self) -> None:
        """A periodic DeviceHours event when one is due (called from the engine's waits)."""
        if self.hours is not None and self.hours.due():
            self.publish_hours()

    # -- at each optimizer step (runs in the last drafter thread to reach the barrier) ---------
    def step_once(self) -> None:
        link = self.link
        if link is None:
            # No batch since the last step (a batch is what brings weight; D-PACE's weight sum is
            # a GPU tensor, and reading it here would wait for the GPU).
            if all(r.micro.samples == 0 for r in self.replicas):
                if self.hs_queue.exhausted():
                    self.finish()
                return
            res = reduce_and_step(self.replicas, self.step, self.total_steps)
        else:
            # Every node decides the same from the same summaries (node_link.py).
            verdict = link.boundary()
            if verdict.stop:
                return
            if not verdict.any_work:
                if verdict.all_exhausted:
                    link.over = True
                    self.finish()
                return
            res = reduce_and_step(self.replicas, self.step, self.total_steps,
                                  across=link.across())
        self.step = res.step
        self.position.commit()
        if link is not None:
            link.after_step()
        now = time.monotonic()
        span = max(now - self.last_step_t, 1e-9)
        self.last_step_t = now
        wait, blocked = self.hs_queue.take_waits()
        tps, sps = self.rate.add(res.tokens, res.samples)
        self.evaluator.stepped(res.tau_tf, self.position.current_epoch())
        self.publish(StepMetrics(
            step=res.step, epoch=self.position.current_epoch(), loss=res.loss, lr=res.lr,
            grad_norm=res.grad_norm, tokens_per_s=tps, samples_per_s=sps, tau_tf=res.tau_tf,
            drafter_wait_frac=min(1.0, wait / (span * len(self.replicas))),
            # per producer: a target GPU, or a target group's batch stream
            target_blocked_frac=min(1.0, blocked / (span * max(1, len(self.targets)))),
            padding_frac=res.padding_frac, samples=res.samples, total_steps=self.total_steps,
            **res.extra))  # DSpark: loss_ce, loss_tv, loss_conf
        self.lifecycle.stepped()
        if self.resume_t0 is not None:
            self.publish(Log(level="info", source="engine", message=(
                f"resume: first step ({res.step}) {time.monotonic() - self.resume_t0:.1f} s "
                "after the resume began reading its checkpoint")))
            self.resume_t0 = None
        self.checkpointer.step_taken(self.step)
        if self.evaluator.due(self.step):
            self.evaluate()
        used_up = verdict.all_exhausted if link is not None else self.hs_queue.exhausted()
        if self.step >= self.total_steps or used_up:
            if link is not None:
                link.over = True  # every node ends at this same step
            self.finish()

    def evaluate(self) -> None:
        """An evaluation (evaluation.py) with the first target and the first replica; a better
        exact tau than any before marks its checkpoint as checkpoints/best. A target group's
        target is decoded through its ranks (target_group/remote.GroupTarget)."""
        target = self.targets[0].model if self.targets else None
        if (not self.writes_records or not self.replicas or target is None
                or self.evaluator is None):
            return
        group = None
        if not getattr(target, "runs_here", True):  # a target group: its layers are elsewhere
            target, group = self._group_target(), self.groups[0]
        self.publish_hours("eval")  # the report's tau against GPU-hours takes this figure
        try:
            tau = self.evaluator.evaluate(self.step, self.replicas[0].drafter, target)
        except GroupClosed:
            raise Stopped() from None
        except GroupRankFailed:
            if group is None or group.first_failure():  # else a stream of the copy said it
                raise
            raise Stopped() from None
        if tau is not None:
            self.checkpointer.keep_best(self.step, tau)

    def _group_target(self):
        """The first target group as the evaluation's target: its verify forwards in its
        ranks, their answers on the first replica's device."""
        if self._group_eval is None:
            from dflash_core.target_group.remote import GroupTarget

            group = self.groups[0]
            self._group_eval = GroupTarget(group, group.heads, self.replicas[0].device)
        return self._group_eval

    # -- what a checkpoint holds of the run ------------------------------------------------------
    def data_identity(self) -> dict:
        """What data the run trains on (checkpoint/data_identity.py): recorded in each checkpoint,
        compared by a resume."""
        if self._data_id is None:
            self._data_id = of_dataset(self.prep.dataset)
        return self._data_id

    def training_state(self, rep: DrafterReplica) -> dict:
        """The run's state at its step with ``rep``'s weights and optimizer: what a checkpoint
        holds (checkpoint-format.md)."""
        epoch, done = self.position.resume_position()
        # DSpark's served folder carries the target's embedding and lm_head (frozen: served
        # only, never in the training state)
        served = rep.drafter.frozen_tensors()
        return dict(
            served_extra=served,
            drafter_state={k: v.detach() for k, v in rep.drafter.state_dict().items()},
            drafter_config=rep.drafter.interchange_config(),
            optimizer_state=rep.optimizer.state_dict(), scheduler_state={"step": self.step},
            trainer_state={"epoch": epoch, "done": done, "total_steps": self.total_steps,
                           "rng": ckpt.capture_rng_state(),
                           # optimizer_state's kind: a resume with another optim.name is refused
                           "optimizer": self.config.optim.name,
                           # absent: one node (checkpoints written before several nodes existed)
                           **({"nodes": self.link.world} if self.link is not None else {}),
                           # the epoch plan's order, which "done" refers to (absent: 1, unbalanced)
                           **({"balance": self.prep.stream.balance} if self.prep is not None
                              else {}),
                           # the data "done" refers to (absent: written before it was recorded)
                           **({"data": self.data_identity()} if self.prep is not None else {}),
                           # the device time that led to these weights (hours_meter.py)
                           **({RECORD_KEY: self.hours.figure().record()}
                              if self.hours is not None else {})})

    def release(self) -> None:
        """Drop the run's models, queues and buffers (teardown, after every worker ended)."""
        for stage in self.targets:
            stage.model = None
        self.targets = []
        self._group_eval = None
        self.replicas = []
        self.checkpointer = self.evaluator = None  # they hold the replicas and the data too
        self.prefetchers = []
        if self.hs_queue is not None:
            self.hs_queue.clear()
        self.hs_queue = None
