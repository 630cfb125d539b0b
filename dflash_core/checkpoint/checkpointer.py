"""The policy the run calls, as a trainer calls its checkpointer: when a checkpoint is written
(periodic, best, final, an abort's within its budget, only when it fits on the disk), the
background writer that writes it, and every call into the rest of this package that a save
makes. The run keeps the step and makes one call per step (``step_taken``); this never calls back
but for the run's training state, which it is given at the start."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from dflash_core.config import CheckpointConfig, ConfigError
from dflash_core.config.eval_sets import set_words
from dflash_core.models.training.replica import DrafterReplica
from dflash_core.observe.events import Checkpoint, CheckpointProgress, Error, Log
from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint import size as checkpoint_size, state_tree
from dflash_core.checkpoint.async_writer import PROBE_BYTES, CheckpointWriter, Outcome
from dflash_core.checkpoint.folders import (
    checkpoint_step, latest_checkpoint, mark_best, read_best,
)
from dflash_core.checkpoint.layout import CHECKPOINTS, MASTER
from dflash_core.checkpoint.size import gib
from dflash_core.checkpoint.staging import enough_shared_memory, stepped_optimizer_state
from dflash_core.units import GiB

DISK_CHECK_S = 60.0  # free space under the run folder is looked at this often while training
# Checkpoints at least this big are written by writer processes; smaller ones (the demo, tests)
# by writer threads, since starting a process (it imports torch) costs more than their write.
PROCESS_WRITER_BYTES = 256 << 20


def checkpoint_bytes(drafter, served_dtype: torch.dtype, optimizer: str) -> int:
    """What one checkpoint of ``drafter`` takes on disk (size.py, as preflight counts
    it): the served weights, the float32 master weights and the state of ``optimizer``; for
    DSpark also the served copies of the target's embedding and lm_head."""
    params, matrices = checkpoint_size.state_counts(drafter.state_dict(),
                                                    getattr(drafter, "adamw_only", ()))
    frozen = getattr(drafter, "frozen_numel", lambda: 0)()  # the family's served copies
    return checkpoint_size.checkpoint_bytes(params, matrices, served_dtype.itemsize, optimizer,
                                            frozen)


def probe_writable(folder: Path) -> None:
    """Write and remove an empty file in ``folder``: an OSError (the folder's errno and words,
    not the probe file's name) where it cannot take one."""
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror) from None


def check_checkpoints_writable(run_dir: Path) -> None:
    """A checkpoints folder that is there but cannot take a checkpoint (a file of that name, a
    folder without write permission) is found now, not at the first save after an hour of
    training. One that is not there yet is made, in the writable run folder, at the first save."""
    folder = run_dir / CHECKPOINTS
    if not os.path.lexists(folder):
        return
    try:
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is a file, not a folder")
        probe_writable(folder)
    except OSError as exc:
        raise ConfigError("run.output_dir", f"cannot write checkpoints to {folder}: {exc}",
                          hint=f"make {folder} a folder you can write (move a file of that name "
                               "away), or set run.output_dir elsewhere") from exc


class Checkpointer:
    """Made at warm-up, once the replicas exist. ``state(replica)``: the run's training state at
    its step with that replica's weights and optimizer (what a checkpoint holds; all replicas
    are equal, replica 0's is written and the others stage their copies in parallel).
    ``records``: this process writes the run's checkpoints (one node, or node 0 of several).
    ``best_set``: eval.best_set, the prompt set whose exact tau checkpoints/best follows."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, publish: Callable[[Any], None], *,
                 replicas: list[DrafterReplica], state: Callable[[DrafterReplica], dict],
                 served_dtype: torch.dtype, optimizer: str, records: bool = True,
                 beat: Callable[[str], None] | None = None, best_set: str = ""):
        self.cfg, self.run_dir, self.publish = cfg, Path(run_dir), publish
        self.replicas, self._state = replicas, state
        self.served_dtype = served_dtype  # model.safetensors' (drafter.dtype)
        self.optimizer = optimizer
        self.records = records
        self._beat = beat or (lambda phase: None)
        self.writer: CheckpointWriter | None = None  # background writes, from warm-up on
        self.saved_step = -1
        self.saved_path: Path | None = None
        self.best_tau: float | None = None  # exact tau of checkpoints/best (read on first use)
        self.best_set = best_set
        self._bytes: int | None = None
        self._disk_ok: bool | None = None
        self._disk_checked = 0.0
        self._disk_warned = False

    def step_taken(self, step: int) -> None:
        """The run took optimizer step ``step``: the disk's room is looked at (warned about while
        low) and the periodic checkpoint written when it is due."""
        self.disk_check()
        if self.due(step):
            self.save("periodic", step)

    def due(self, step: int) -> bool:
        """A periodic checkpoint is due at this step."""
        return bool(self.cfg.every) and step % self.cfg.every == 0

    def checkpoint_bytes(self) -> int:
        if self._bytes is None:
            self._bytes = checkpoint_bytes(self.replicas[0].drafter, self.served_dtype,
                                           self.optimizer)
        return self._bytes

    def disk_check(self, fresh: bool = False) -> bool:
        """Whether one more checkpoint fits under the run folder; warns (once until it recovers)
        while less than two checkpoints' worth is free. Looks at most every DISK_CHECK_S."""
        now = time.monotonic()
        if not fresh and self._disk_ok is not None and now - self._disk_checked < DISK_CHECK_S:
            return self._disk_ok
        self._disk_checked = now
        need = self.checkpoint_bytes()
        free = shutil.disk_usage(self.run_dir).free
        low = free < 2 * need
        if low and not self._disk_warned:
            self.publish(Log(level="warning", source="engine", message=(
                f"disk nearly full: {free / GiB:.1f} GiB free under {self.run_dir}, one "
                f"checkpoint takes ~{need / GiB:.1f} GiB; free space or move run.output_dir")))
        self._disk_warned = low
        self._disk_ok = free >= need
        return self._disk_ok

    # -- the writer ---------------------------------------------------------------------------
    def start(self, step: int) -> None:
        """At warm-up: the background writers, their staging arena, and the write rate, so
        the first checkpoint only copies and an abort knows whether it fits its budget."""
        if not self.records or not self.replicas:
            return
        cfg, publish = self.cfg, self.publish
        t0 = time.monotonic()
        need = self.checkpoint_bytes()
        writers = cfg.writers or len(self.replicas)
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
        self.writer = CheckpointWriter(self.run_dir, writers, mode=mode, on_progress=progress,
                                       beat=lambda: self._beat("writing a checkpoint"))
        rep = self.replicas[0]
        state = self._state(rep)
        state["optimizer_state"] = stepped_optimizer_state(rep.optimizer)
        self.writer.start()
        self.writer.reserve(ckpt.make_job(step, served_dtype=self.served_dtype,
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
        budget = cfg.abort_budget_s
        if cfg.on_abort and est is not None and est > budget:
            publish(Log(level="warning", source="engine", message=(
                f"an abort checkpoint needs ~{est:.0f} s, over checkpoint.abort_budget_s "
                f"({budget:g} s); the last periodic one will stand (raise the budget with the "
                "grace period before SIGKILL, or write to a faster disk)")))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    # -- a save -------------------------------------------------------------------------------
    def save(self, reason: str, step: int, tau: float = -1.0) -> Path | None:
        """Periodic and best checkpoints go to the background writers (training waits only for
        staging); final and abort ones wait until durable (an abort within its budget)."""
        if not self.records:
            return None
        if not self.replicas or self.saved_step == step:
            return self.saved_path if self.saved_step == step else None
        publish = self.publish
        if not self.disk_check(fresh=True):
            publish(Log(level="warning", source="engine", message=(
                f"{reason} checkpoint at step {step} skipped: it does not fit in the free "
                f"space under {self.run_dir}; the last good checkpoint stands")))
            return None
        if self.writer is None:  # before warm-up made the writers: in this thread
            t = time.monotonic()
            self.saved_step = step
            path = self.saved_path = ckpt.save_checkpoint(
                self.run_dir, step, served_dtype=self.served_dtype,
                keep=self.cfg.keep, **self._state(self.replicas[0]),
                note=lambda m: publish(Log(level="warning", source="checkpoint", message=m)))
            if reason == "best":
                mark_best(self.run_dir, path, step, tau, self.best_set)
            publish(Checkpoint(step=step, path=str(path), seconds=time.monotonic() - t,
                               reason=reason, tau=tau, bytes=self.checkpoint_bytes(),
                               prompt_set=self._set_of(reason)))
            return path
        t0 = time.monotonic()
        budget = self.cfg.abort_budget_s if reason == "abort" else None
        if budget is not None:
            if not self._abort_fits(budget, step):
                return None
        done = self._outcome(reason, tau)  # what the writer says when the write has ended
        writers = self.writer.writers
        job = ckpt.make_job(step, served_dtype=self.served_dtype, writers=writers,
                            **self._state(self.replicas[0]))
        sources = [job.tensors] + [self._tensors(r) for r in self.replicas[1:]]
        self.saved_step = step
        self.saved_path = self.run_dir / CHECKPOINTS / f"step-{step}"
        self.writer.save(job, sources, keep=self.cfg.keep, reason=reason, on_done=done)
        if reason in ("periodic", "best"):
            return self.saved_path
        left = None if budget is None else max(0.0, budget - (time.monotonic() - t0))
        outcome = self.writer.wait(left)
        if outcome is None:  # ran over its budget: abandoned, the process must exit in time
            self._abandon(f"abort checkpoint of step {step}", budget)
            return None
        return outcome.path

    def keep_best(self, step: int, tau: float) -> None:
        """checkpoints/best names the checkpoint with the highest exact tau so far; a better
        evaluation at a step without a checkpoint saves one for it. Resume still uses the
        latest."""
        if self.best_tau is None:
            self.best_tau = self._best_so_far()
        if tau <= self.best_tau or step == 0:
            return
        if self.saved_step == step and self.saved_path is not None:
            if self.writer is not None:
                self.writer.wait_idle()  # it names a folder that must exist
            if not self.saved_path.is_dir():
                return  # its write failed (said by its Error)
            mark_best(self.run_dir, self.saved_path, step, tau, self.best_set)  # this step's
            self.publish(Checkpoint(step=step, path=str(self.saved_path), seconds=0.0,
                                    reason="best", tau=tau, prompt_set=self.best_set))
        elif self.save("best", step, tau=tau) is None:
            return  # no room on the disk: said by save
        self.best_tau = tau

    def _best_so_far(self) -> float:
        """The exact tau checkpoints/best was chosen by, when it is on this run's eval.best_set.
        A resume that changed eval.best_set compares taus of different prompts: the best is
        chosen again from the new set's, and the run says so."""
        best = read_best(self.run_dir)
        if not best:
            return float("-inf")
        before = str(best.get("prompt_set", ""))
        if before == self.best_set:
            return float(best["tau"])
        self.publish(Log(level="warning", source="checkpoint", message=(
            f"checkpoints/best (step {best['step']}) was chosen by exact tau "
            f"{float(best['tau']):.4f} on {set_words(before)}; eval.best_set now names "
            f"{set_words(self.best_set)}: the best is chosen again from its tau, from this "
            "evaluation on")))
        return float("-inf")

    def _set_of(self, reason: str) -> str:
        return self.best_set if reason == "best" else ""

    def _outcome(self, reason: str, tau: float) -> Callable[[Outcome], None]:
        prev = (self.saved_path, self.saved_step)
        publish = self.publish

        def done(o: Outcome) -> None:
            for note in o.notes:  # a damaged folder of this step, set aside before the write
                publish(Log(level="warning", source="checkpoint", message=note))
            if o.path is None and o.abandoned:  # an abort out of time: its caller says so
                self.saved_path, self.saved_step = prev
                return
            if o.path is None:
                self.saved_path, self.saved_step = prev
                stands = (f"the checkpoint at step {checkpoint_step(prev[0])} stands"
                          if prev[0] is not None else "no earlier checkpoint of this run")
                err = ckpt._io_error(OSError(o.errno, o.error), self.run_dir) \
                    if o.errno else None
                publish(Error(error_kind="io", source="checkpoint", fatal=False, phase="training",
                              message=(f"{reason} checkpoint of step {o.step} could not be "
                                       f"written to {ckpt.tmp_folder(self.run_dir, o.step)}"
                                       f": {o.error}; {stands}"),
                              hint=(err.hint if err is not None else
                                    "the next checkpoint starts a new writer; check the disk "
                                    "and the host's memory if writers keep dying")))
                return
            self.saved_path = o.path
            if reason == "best":
                mark_best(self.run_dir, o.path, o.step, tau, self.best_set)
            publish(Checkpoint(step=o.step, path=str(o.path), seconds=o.seconds, reason=reason,
                               tau=tau, bytes=o.bytes, blocked_s=o.blocked_s,
                               prompt_set=self._set_of(reason)))
        return done

    def _abandon(self, what: str, budget: float) -> None:
        """Stop the write past the abort's budget and say which checkpoint stands."""
        self.writer.kill()
        self.writer.wait(5.0)
        self.publish(Log(level="warning", source="engine", message=(
            f"{what} did not finish within checkpoint.abort_budget_s ({budget:g} s); "
            f"abandoned, {self._stands()}")))

    def _stands(self) -> str:
        last = latest_checkpoint(self.run_dir)
        return (f"the checkpoint at step {checkpoint_step(last)} stands ({last})"
                if last is not None else "no checkpoint of this run stands")

    def _abort_fits(self, budget: float, step: int) -> bool:
        """An abort's checkpoint fits its budget by the measured rate (after the write in
        flight, which it waits for); if not, say which checkpoint stands."""
        t0 = time.monotonic()
        if not self.writer.wait_idle(budget):
            self._abandon("abort: the checkpoint being written", budget)
            return False
        est = self.writer.estimate_s(self.checkpoint_bytes())
        left = budget - (time.monotonic() - t0)
        if est is not None and est > left:
            self.publish(Log(level="warning", source="engine", message=(
                f"abort: no checkpoint of step {step}: it needs ~{est:.0f} s and "
                f"{max(left, 0):.0f} s of checkpoint.abort_budget_s ({budget:g} s) are left; "
                f"{self._stands()}")))
            return False
        return True

    @staticmethod
    def _tensors(rep) -> dict[str, torch.Tensor]:
        """A replica's master weights and optimizer tensors, named as make_job names them."""
        out = {f"{MASTER}/{k}": v.detach() for k, v in rep.drafter.state_dict().items()}
        state_tree.flatten(rep.optimizer.state_dict(), "optimizer", out)
        return out
