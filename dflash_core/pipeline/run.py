"""Everything one run owns, made whole when the run starts and dropped whole when it ends (so a
restart can never see the last run's state), and what the run does at each optimizer step:
reduce and step, report, checkpoint, evaluate."""

from __future__ import annotations

import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from dflash_core.persist import checkpoint as ckpt
from dflash_core.config import Config
from dflash_core.data import Prefetcher
from dflash_core.persist.data_identity import of_dataset
from dflash_core.persist.data_position import DataPosition
from dflash_core.models import acceptance
from dflash_core.models.agreement import label_agreement
from dflash_core.models.evaluate import (
    evaluate_tau,
    evaluation_attention,
    features_fn_for,
    target_fn_for,
    teacher_forced_eval,
)
from dflash_core.observe.events import (
    Checkpoint, CheckpointProgress, Error, EvalResult, Log, StepMetrics,
)
from dflash_core.persist import checkpoint_size, state_tree
from dflash_core.persist.checkpoint_size import gib
from dflash_core.persist.async_writer import (
    PROBE_BYTES, CheckpointWriter, Outcome, enough_shared_memory, stepped_optimizer_state,
)
from dflash_core.pipeline.hs_queue import HiddenStateQueue
from dflash_core.planning.preflight import Prepared
from dflash_core.observe.sinks.run_sinks import RunSinks
from dflash_core.pipeline.target_stage import TargetStage
from dflash_core.models.trainer import DrafterReplica, RateMeter, StepBarrier, reduce_and_step
from dflash_core.multinode.node_link import NodeLink
from dflash_core.planning.layout_advice import LayoutAdvisor
from dflash_core.units import GiB
from dflash_core.observe.watchdog import Heartbeats

DISK_CHECK_S = 60.0  # free space under the run folder is looked at this often while training
# Checkpoints at least this big are written by writer processes; smaller ones (the demo, tests)
# by writer threads, since starting a process (it imports torch) costs more than their write.
PROCESS_WRITER_BYTES = 256 << 20


@dataclass
class Run:
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
    drafter_devices: list[torch.device] = field(default_factory=list)
    prep: Prepared | None = None
    resume: ckpt.LoadedCheckpoint | None = None

    # loading and training
    threads: list[threading.Thread] = field(default_factory=list)
    prefetchers: list[Prefetcher] = field(default_factory=list)
    targets: list[TargetStage] = field(default_factory=list)
    hs_queue: HiddenStateQueue | None = None
    position: DataPosition | None = None
    replicas: list[DrafterReplica] = field(default_factory=list)
    barrier: StepBarrier | None = None
    rate: RateMeter = field(default_factory=RateMeter)
    step: int = 0
    saved_step: int = -1
    last_step_t: float = field(default_factory=time.monotonic)
    last_tau_tf: float | None = None  # teacher-forced tau of the last step
    # teacher-forced tau of the recent steps: the training tau (d) of an evaluation is their mean
    recent_tau_tf: deque = field(default_factory=lambda: deque(maxlen=50))
    agreement: tuple[int, int] | None = None  # (agree, total), measured at the first evaluation
    # the evaluation's block attention once the compiled one failed to build for its shapes
    evaluated_step: int = -1  # the end of a run evaluates again only when it is a new step
    best_tau: float | None = None  # exact tau of checkpoints/best (read from it on first use)
    saved_path: Path | None = None
    advisor: LayoutAdvisor | None = None  # a bus tap while the run trains
    # Several nodes (None on one node): made from the run's config once it is read; it reads
    # and sets this run only as node_link.LinkedRun says. peer_failed: the run failed because
    # another node did; this node's weights are those of the last step all took, so node 0
    # still writes its checkpoint.
    link: NodeLink | None = None
    peer_failed: bool = False
    _ckpt_bytes: int | None = None
    writer: CheckpointWriter | None = None  # background checkpoints, from warm-up on
    resume_t0: float | None = None  # when --resume began reading, until the first step
    _data_id: dict | None = None
    _disk_ok: bool | None = None
    _disk_checked: float = 0.0
    _disk_warned: bool = False

    @property
    def total_steps(self) -> int:
        return self.prep.total_steps if self.prep is not None else 0

    def finish(self) -> None:
        self.finished = True
        self.stop.set()

    # -- at each optimizer step (runs in the last drafter thread to reach the barrier) ---------
    def step_once(self, publish: Callable[[Any], None], on_metrics: Callable[[], None]) -> None:
        cfg = self.config
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
        self.last_tau_tf = res.tau_tf
        if self.recent_tau_tf.maxlen != cfg.eval.train_tau_steps:
            self.recent_tau_tf = deque(self.recent_tau_tf, maxlen=cfg.eval.train_tau_steps)
        self.recent_tau_tf.append(res.tau_tf)
        publish(StepMetrics(
            step=res.step, epoch=self.position.current_epoch(), loss=res.loss, lr=res.lr,
            grad_norm=res.grad_norm, tokens_per_s=tps, samples_per_s=sps, tau_tf=res.tau_tf,
            drafter_wait_frac=min(1.0, wait / (span * len(self.replicas))),
            target_blocked_frac=min(1.0, blocked / (span * len(self.target_devices))),
            padding_frac=res.padding_frac, samples=res.samples, total_steps=self.total_steps))
        on_metrics()
        if self.resume_t0 is not None:
            publish(Log(level="info", source="engine", message=(
                f"resume: first step ({res.step}) {time.monotonic() - self.resume_t0:.1f} s "
                "after the resume began reading its checkpoint")))
            self.resume_t0 = None
        self.disk_check(publish)
        if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
            self.save_checkpoint("periodic", publish)
        if cfg.eval.every and self.step % cfg.eval.every == 0:
            self.evaluate(publish)
        used_up = verdict.all_exhausted if link is not None else self.hs_queue.exhausted()
        if self.step >= self.total_steps or used_up:
            if link is not None:
                link.over = True  # every node ends at this same step
            self.finish()

    def served_dtype(self) -> torch.dtype:
        """model.safetensors' dtype: the drafter's (drafter.dtype), whatever it trains in."""
        return getattr(torch, self.config.drafter.dtype)

    def checkpoint_bytes(self) -> int:
        """What one checkpoint takes on disk (checkpoint_size.py, as preflight counts it): the
        served weights, the float32 master weights and the optimizer's state."""
        if self._ckpt_bytes is None:
            params, matrices = checkpoint_size.state_counts(self.replicas[0].drafter.state_dict())
            self._ckpt_bytes = checkpoint_size.checkpoint_bytes(
                params, matrices, self.served_dtype().itemsize,
                self.config.optim.name)
        return self._ckpt_bytes

    def disk_check(self, publish: Callable[[Any], None], fresh: bool = False) -> bool:
        """Whether one more checkpoint fits under the run folder; warns (once until it recovers)
        while less than two checkpoints' worth is free. Looks at most every DISK_CHECK_S."""
        now = time.monotonic()
        if not fresh and self._disk_ok is not None and now - self._disk_checked < DISK_CHECK_S:
            return self._disk_ok
        self._disk_checked = now
        need = self.checkpoint_bytes()
        free = shutil.disk_usage(self.config.run_dir).free
        low = free < 2 * need
        if low and not self._disk_warned:
            publish(Log(level="warning", source="engine", message=(
                f"disk nearly full: {free / GiB:.1f} GiB free under {self.config.run_dir}, one "
                f"checkpoint takes ~{need / GiB:.1f} GiB; free space or move run.output_dir")))
        self._disk_warned = low
        self._disk_ok = free >= need
        return self._disk_ok

    @property
    def writes_records(self) -> bool:
        """Checkpoints and evaluations: on one node, or on node 0 of several."""
        return self.link is None or self.link.lead

    def data_identity(self) -> dict:
        """What data the run trains on (persist/data_identity.py): recorded in each checkpoint,
        compared by a resume."""
        if self._data_id is None:
            self._data_id = of_dataset(self.prep.dataset)
        return self._data_id

    def _state(self, rep) -> dict:
        epoch, done = self.position.resume_position()
        return dict(
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
                           **({"data": self.data_identity()} if self.prep is not None else {})})

    def start_writer(self, publish: Callable[[Any], None]) -> None:
        """At warm-up: the background writers, their staging arena, and the write rate, so
        the first checkpoint only copies and an abort knows whether it fits its budget."""
        if not self.writes_records or not self.replicas:
            return
        cfg = self.config
        t0 = time.monotonic()
        need = self.checkpoint_bytes()
        writers = cfg.checkpoint.writers or len(self.replicas)
        mode = "process" if need >= PROCESS_WRITER_BYTES else "thread"
        if mode == "process" and not enough_shared_memory(need):
            mode = "thread"
            publish(Log(level="warning", source="engine", message=(
                f"checkpoints: /dev/shm cannot hold the {need / GiB:.1f} GiB staging buffer; "
                "writing them from threads of this process (give the container more shared "
                "memory, e.g. docker --shm-size, to write from separate processes)")))

        def progress(step, written, total, seconds, reason):
            publish(CheckpointProgress(step=step, bytes_written=written, bytes_total=total,
                                       seconds=seconds, reason=reason))
        self.writer = CheckpointWriter(cfg.run_dir, writers, mode=mode, on_progress=progress,
                                       beat=lambda: self.heartbeats.beat("writing a checkpoint"))
        rep = self.replicas[0]
        state = self._state(rep)
        state["optimizer_state"] = stepped_optimizer_state(rep.optimizer)
        self.writer.start()
        self.writer.reserve(ckpt.make_job(self.step, served_dtype=self.served_dtype(),
                                          writers=writers, **state).tensors)
        # As much as one checkpoint at most: a small one's probe must not cost more than it.
        rate = self.writer.probe(min(PROBE_BYTES, need))
        pinned = "pinned " if self.writer.staging.pinned else ""
        publish(Log(level="info", source="engine", message=(
            f"checkpoints: {gib(need)} each, staged in {gib(self.writer.staging.nbytes)}"
            f" of {pinned}host memory, written by {writers} writer "
            f"{'processes' if self.writer.mode == 'process' else 'threads'}"
            + (f" at {gib(int(rate))}/s (measured)" if rate else "")
            + f"; ready in {time.monotonic() - t0:.1f} s")))
        est = self.writer.estimate_s(need)
        budget = cfg.checkpoint.abort_budget_s
        if cfg.checkpoint.on_abort and est is not None and est > budget:
            publish(Log(level="warning", source="engine", message=(
                f"an abort checkpoint needs ~{est:.0f} s, over checkpoint.abort_budget_s "
                f"({budget:g} s); the last periodic one will stand (raise the budget with the "
                "grace period before SIGKILL, or write to a faster disk)")))

    def _outcome(self, reason: str, tau: float, publish: Callable[[Any], None]
                 ) -> Callable[[Outcome], None]:
        prev = (self.saved_path, self.saved_step)

        def done(o: Outcome) -> None:
            for note in o.notes:  # a damaged folder of this step, set aside before the write
                publish(Log(level="warning", source="checkpoint", message=note))
            if o.path is None and o.abandoned:  # an abort out of time: its caller says so
                self.saved_path, self.saved_step = prev
                return
            if o.path is None:
                self.saved_path, self.saved_step = prev
                stands = (f"the checkpoint at step {ckpt.checkpoint_step(prev[0])} stands"
                          if prev[0] is not None else "no earlier checkpoint of this run")
                err = ckpt._io_error(OSError(o.errno, o.error), self.config.run_dir) \
                    if o.errno else None
                publish(Error(error_kind="io", source="checkpoint", fatal=False, phase="training",
                              message=(f"{reason} checkpoint of step {o.step} could not be "
                                       f"written to {ckpt.tmp_folder(self.config.run_dir, o.step)}"
                                       f": {o.error}; {stands}"),
                              hint=(err.hint if err is not None else
                                    "the next checkpoint starts a new writer; check the disk "
                                    "and the host's memory if writers keep dying")))
                return
            self.saved_path = o.path
            if reason == "best":
                ckpt.mark_best(self.config.run_dir, o.path, o.step, tau)
            publish(Checkpoint(step=o.step, path=str(o.path), seconds=o.seconds, reason=reason,
                               tau=tau, bytes=o.bytes, blocked_s=o.blocked_s))
        return done

    def save_checkpoint(self, reason: str, publish: Callable[[Any], None],
                        tau: float = -1.0) -> Path | None:
        """Periodic and best checkpoints go to the background writers (training waits only for
        staging); final and abort ones wait until durable (an abort within its budget)."""
        if not self.writes_records:
            return None
        if not self.replicas or self.saved_step == self.step:
            return self.saved_path if self.saved_step == self.step else None
        if not self.disk_check(publish, fresh=True):
            publish(Log(level="warning", source="engine", message=(
                f"{reason} checkpoint at step {self.step} skipped: it does not fit in the free "
                f"space under {self.config.run_dir}; the last good checkpoint stands")))
            return None
        cfg = self.config
        if self.writer is None:  # before warm-up made the writers: in this thread
            t = time.monotonic()
            self.saved_step = self.step
            path = self.saved_path = ckpt.save_checkpoint(
                cfg.run_dir, self.step, served_dtype=self.served_dtype(),
                keep=cfg.checkpoint.keep, **self._state(self.replicas[0]),
                note=lambda m: publish(Log(level="warning", source="checkpoint", message=m)))
            if reason == "best":
                ckpt.mark_best(cfg.run_dir, path, self.step, tau)
            publish(Checkpoint(step=self.step, path=str(path), seconds=time.monotonic() - t,
                               reason=reason, tau=tau, bytes=self.checkpoint_bytes()))
            return path
        t0 = time.monotonic()
        budget = cfg.checkpoint.abort_budget_s if reason == "abort" else None
        if budget is not None:
            if not self._abort_fits(budget, publish):
                return None
        writers = self.writer.writers
        job = ckpt.make_job(self.step, served_dtype=self.served_dtype(), writers=writers,
                            **self._state(self.replicas[0]))
        sources = [job.tensors] + [self._tensors(r) for r in self.replicas[1:]]
        done = self._outcome(reason, tau, publish)
        self.saved_step = self.step
        self.saved_path = Path(cfg.run_dir) / ckpt.CHECKPOINTS / f"step-{self.step}"
        self.writer.save(job, sources, keep=cfg.checkpoint.keep, reason=reason, on_done=done)
        if reason in ("periodic", "best"):
            return self.saved_path
        left = None if budget is None else max(0.0, budget - (time.monotonic() - t0))
        outcome = self.writer.wait(left)
        if outcome is None:  # ran over its budget: abandoned, the process must exit in time
            self._abandon(f"abort checkpoint of step {self.step}", budget, publish)
            return None
        return outcome.path

    def _abandon(self, what: str, budget: float, publish: Callable[[Any], None]) -> None:
        """Stop the write past the abort's budget and say which checkpoint stands."""
        self.writer.kill()
        self.writer.wait(5.0)
        publish(Log(level="warning", source="engine", message=(
            f"{what} did not finish within checkpoint.abort_budget_s ({budget:g} s); "
            f"abandoned, {self._stands()}")))

    def _stands(self) -> str:
        last = ckpt.latest_checkpoint(self.config.run_dir)
        return (f"the checkpoint at step {ckpt.checkpoint_step(last)} stands ({last})"
                if last is not None else "no checkpoint of this run stands")

    def _abort_fits(self, budget: float, publish: Callable[[Any], None]) -> bool:
        """An abort's checkpoint fits its budget by the measured rate (after the write in
        flight, which it waits for); if not, say which checkpoint stands."""
        t0 = time.monotonic()
        if not self.writer.wait_idle(budget):
            self._abandon("abort: the checkpoint being written", budget, publish)
            return False
        est = self.writer.estimate_s(self.checkpoint_bytes())
        left = budget - (time.monotonic() - t0)
        if est is not None and est > left:
            publish(Log(level="warning", source="engine", message=(
                f"abort: no checkpoint of step {self.step}: it needs ~{est:.0f} s and "
                f"{max(left, 0):.0f} s of checkpoint.abort_budget_s ({budget:g} s) are left; "
                f"{self._stands()}")))
            return False
        return True

    def _tensors(self, rep) -> dict[str, torch.Tensor]:
        """A replica's master weights and optimizer tensors, named as make_job names them."""
        out = {f"{ckpt.MASTER}/{k}": v.detach() for k, v in rep.drafter.state_dict().items()}
        state_tree.flatten(rep.optimizer.state_dict(), "optimizer", out)
        return out

    def close_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def evaluate(self, publish: Callable[[Any], None]) -> None:
        """The measures of acceptance (models/acceptance.py), with the first target and the
        first replica: exact tau on the held-out prompts, teacher-forced tau on the target's
        own decoding of them and on the held-out samples, the training tau of the recent steps,
        and at the first evaluation the data/target agreement; then each finding's message."""
        cfg, prep = self.config, self.prep
        target = self.targets[0].model if self.targets else None
        if not self.writes_records:
            return
        if not len(prep.eval_indices) or not self.replicas or target is None:
            return
        if self.evaluated_step == self.step:  # the last periodic evaluation was this step
            return
        t0 = time.monotonic()
        prompts = eval_prompts(prep.dataset, prep.eval_indices, cfg.eval.prompt_tokens)
        # (c) scores as many response tokens as (a) decodes, on the data's own labels
        heldout = heldout_samples(prep.dataset, prep.eval_indices, cfg.eval.prompt_tokens,
                                  cfg.eval.max_new_tokens, cfg.data.max_length)
        measured = self._measure(self.replicas[0].drafter, target, prompts, heldout, publish)
        res, (tf_target, n_target), (tf_all, n_all), (tf_heldout, n_heldout) = measured
        if self.agreement is None and cfg.eval.agreement_samples:
            self.agreement = self._agreement(target)
        agree, total = self.agreement or (0, 0)
        share = agree / total if total else acceptance.MISSING
        train = (float(np.mean(self.recent_tau_tf)) if self.recent_tau_tf
                 else acceptance.MISSING)
        miss = acceptance.MISSING
        tf_target = tf_target if n_target else miss
        tf_all = tf_all if n_all else miss
        tf_heldout = tf_heldout if n_heldout else miss
        found = acceptance.findings(self.step, res.tau, tf_target, tf_heldout, train, share,
                                    cfg.eval, target_all=tf_all)
        publish(EvalResult(
            step=self.step, tau=res.tau, acceptance=list(res.acceptance), prompts=len(prompts),
            tau_tf_target=tf_target, tau_tf_target_all=tf_all, tau_tf_heldout=tf_heldout,
            tau_tf_train=train, agreement=share, agreement_positions=total,
            findings=[f.kind for f in found], seconds=time.monotonic() - t0))
        self.evaluated_step = self.step
        for f in found:
            publish(Log(level=f.level, source="eval", message=f.message))
        self._mark_best(res.tau, publish)

    def _measure(self, drafter, target, prompts, heldout, publish) -> tuple:
        """(exact decoding, and (tau, positions) of the three teacher-forced measures) with the
        drafter in eval mode and the evaluation's attention (``evaluation_attention``)."""
        cfg, layer_ids = self.config, self.prep.layer_ids
        with evaluation_attention(drafter):
            res = evaluate_tau(target_fn_for(target, layer_ids, cache=cfg.eval.cache),
                               drafter, prompts, cfg.eval.max_new_tokens, layer_ids)
            decoded = [(p + out, [0] * len(p) + [1] * len(out))
                       for p, out in zip(prompts, res.outputs)]
            feats = features_fn_for(target, layer_ids)
            chunk = cfg.drafter.loss_chunk
            # (b) at the anchors decoding used, to compare with (a); at every position, to
            # compare with (c), which has no decoding anchors
            return (res, teacher_forced_eval(feats, drafter, decoded, chunk, anchors=res.anchors),
                    teacher_forced_eval(feats, drafter, decoded, chunk),
                    teacher_forced_eval(feats, drafter, heldout, chunk))

    def _agreement(self, target_model) -> tuple[int, int]:
        """(agree, total) on ``eval.agreement_samples`` training samples spread over the data
        set (never the held-out ones), each cut to data.max_length as training cuts it."""
        cfg, prep = self.config, self.prep
        train = np.setdiff1d(np.arange(len(prep.dataset)), prep.eval_indices)
        if not len(train):
            return 0, 0
        k = min(cfg.eval.agreement_samples, len(train))
        picks = np.unique(train[np.linspace(0, len(train) - 1, k).round().astype(int)])
        rows = [prep.dataset.get(int(i)) for i in picks]
        L = cfg.data.max_length
        return label_agreement(target_model, [r[0][:L] for r in rows], [r[1][:L] for r in rows],
                               max_positions=cfg.eval.agreement_positions, seed=cfg.run.seed)

    def _mark_best(self, tau: float, publish: Callable[[Any], None]) -> None:
        """checkpoints/best names the checkpoint with the highest exact tau so far; a better
        evaluation at a step without a checkpoint saves one for it. Resume still uses the
        latest."""
        run_dir = self.config.run_dir
        if self.best_tau is None:
            best = ckpt.read_best(run_dir)
            self.best_tau = float(best["tau"]) if best else float("-inf")
        if tau <= self.best_tau or self.step == 0:
            return
        if self.saved_step == self.step and self.saved_path is not None:
            if self.writer is not None:
                self.writer.wait_idle()  # it names a folder that must exist
            if not self.saved_path.is_dir():
                return  # its write failed (said by its Error)
            ckpt.mark_best(run_dir, self.saved_path, self.step, tau)  # this step's checkpoint
            publish(Checkpoint(step=self.step, path=str(self.saved_path), seconds=0.0,
                               reason="best", tau=tau))
        elif self.save_checkpoint("best", publish, tau=tau) is None:
            return  # no room on the disk: said by save_checkpoint
        self.best_tau = tau

    def release(self) -> None:
        """Drop the run's models, queues and buffers (teardown, after every worker ended)."""
        for stage in self.targets:
            stage.model = None
        self.targets = []
        self.replicas = []
        self.prefetchers = []
        if self.hs_queue is not None:
            self.hs_queue.clear()
        self.hs_queue = None


def _prompt_cut(ids, mask, prompt_tokens: int) -> int:
    """Where a held-out sample's prompt ends: at a turn boundary of the data (where a trained
    span begins, the end of a generation prompt), the last one within ``prompt_tokens``, else
    the first; at ``prompt_tokens`` only when the sample has none (trained from 0, or not at
    all). A prompt cut inside a turn would have the target continue the user's text, not answer
    it, and (b) would then score other text than the data's answers."""
    m = np.asarray(mask) > 0
    starts = np.flatnonzero(m[1:] & ~m[:-1]) + 1
    if not len(starts):
        return min(len(ids) - 1, prompt_tokens)
    within = starts[starts <= prompt_tokens]
    return int(within[-1] if len(within) else starts[0])


def eval_prompts(dataset, indices, prompt_tokens: int) -> list[list[int]]:
    """The prompts of exact tau: each held-out sample cut at a turn boundary (``_prompt_cut``:
    within ``prompt_tokens`` when the sample has one there, else at its first), or to
    ``prompt_tokens`` when it has none."""
    prompts = []
    for i in indices:
        ids, mask = dataset.get(int(i))
        prompts.append([int(x) for x in ids[: _prompt_cut(ids, mask, prompt_tokens)]])
    return prompts


def heldout_samples(dataset, indices, prompt_tokens: int, new_tokens: int, max_length: int):
    """(input_ids, loss_mask) of each held-out sample up to ``new_tokens`` past its prompt's end
    (and at most ``max_length``, as training cuts it): what (c) scores on the data's labels."""
    out = []
    for i in indices:
        ids, mask = dataset.get(int(i))
        end = min(len(ids), _prompt_cut(ids, mask, prompt_tokens) + new_tokens, max_length)
        out.append((ids[:end], mask[:end]))
    return out
