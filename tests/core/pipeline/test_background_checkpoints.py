"""Checkpoints written in the background by a running engine: an abort's checkpoint within
checkpoint.abort_budget_s (or none, naming the checkpoint that stands), and a writer process
killed mid-write. The disk's speed is modelled (writer_loop.clock, safetensors_io._write), not
waited for."""

import multiprocessing
import os
import re
import signal
import time

import pytest

from dflash_core.observe.events import (
    Checkpoint, CheckpointProgress, Error, Log, RunEnded, StepMetrics,
)
from dflash_core.checkpoint import async_writer, safetensors_io, writer_loop
from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.folders import latest_checkpoint
from dflash_core.checkpoint.layout import CHECKPOINTS
from dflash_core.checkpoint import checkpointer
from dflash_core.pipeline import run as run_mod
from dflash_core.pipeline.engine import Engine

from ..engine_fixtures import (  # noqa: F401 - assets, shutdown_started_engines: fixtures
    FAIL_WITHIN_S, Recorder, assets, ended, long_config, run_to_end, shutdown_started_engines,
    started, wait_gone,
)
from ..checkpoint import writer_targets


def model_disk(monkeypatch, bytes_per_s: float) -> None:
    """Every byte the writers put on disk takes 1 / bytes_per_s seconds on the writers' clock
    (the probe's and the checkpoints' measured rate), at no cost in real time."""
    ahead = [0.0]
    real = safetensors_io._write

    def write(fd, view):
        real(fd, view)
        ahead[0] += len(view) / bytes_per_s
    monkeypatch.setattr(safetensors_io, "_write", write)
    monkeypatch.setattr(writer_loop, "clock", lambda: time.monotonic() + ahead[0])


def abort_at_step_3(monkeypatch, engine: Engine, cfg, on_abort=None) -> list[float]:
    """Abort ``engine`` right after step 3, once step 2's periodic checkpoint is durable (so no
    write is in flight when the abort's checkpoint is decided). Returns [the abort's time]."""
    real = run_mod.reduce_and_step
    step2 = cfg.run_dir / CHECKPOINTS / "step-2"

    def reduce_and_step(replicas, step, total, **kw):
        if step == 2:  # the step that makes step 3; no bus lock is held here
            deadline = time.monotonic() + 30
            while not step2.is_dir() and time.monotonic() < deadline:
                time.sleep(0.01)
        return real(replicas, step, total, **kw)
    monkeypatch.setattr(run_mod, "reduce_and_step", reduce_and_step)
    when = []

    def tap(ev):
        if isinstance(ev, StepMetrics) and ev.step == 3 and not when:
            when.append(ev.ts)
            if on_abort is not None:
                on_abort()
            engine.abort()
    engine.bus.tap(tap)
    return when


def hidden(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / CHECKPOINTS).iterdir() if p.name.startswith("."))


def warnings(rec) -> list[str]:
    return [e.message for e in rec.of(Log) if e.level == "warning"]


def test_an_abort_that_cannot_meet_its_budget_writes_none_and_names_the_step_that_stands(
        tmp_path, assets, monkeypatch):
    model_disk(monkeypatch, bytes_per_s=10_000)  # a ~160 KB checkpoint: ~16 s
    cfg = long_config(tmp_path, assets, checkpoint__every=2, checkpoint__abort_budget_s=5)
    engine = Engine(cfg)
    when = abort_at_step_3(monkeypatch, engine, cfg)
    rec = run_to_end(engine)
    engine.shutdown()
    end = rec.of(RunEnded)[0]
    assert end.status == "aborted" and end.step == 3
    assert end.ts - when[0] < FAIL_WITHIN_S
    # said at start, with the estimate from the measured rate
    (start,) = [w for w in warnings(rec) if w.startswith("an abort checkpoint needs")]
    est = int(re.match(r"an abort checkpoint needs ~(\d+) s", start).group(1))
    assert 12 <= est <= 20, start
    assert start.endswith(f"over checkpoint.abort_budget_s (5 s); the last periodic one will stand "
                          "(raise the budget with the grace period before SIGKILL, or write to a "
                          "faster disk)")
    # on abort: none written, and the one that stands named
    step2 = cfg.run_dir / CHECKPOINTS / "step-2"
    (said,) = [w for w in warnings(rec) if w.startswith("abort:")]
    assert re.match(r"abort: no checkpoint of step 3: it needs ~\d+ s and [45] s of "
                    r"checkpoint.abort_budget_s \(5 s\) are left; the checkpoint at step 2 "
                    rf"stands \({re.escape(str(step2))}\)$", said), said
    assert [(c.step, c.reason) for c in rec.of(Checkpoint)] == [(2, "periodic")]
    assert not rec.of(Error)
    assert ckpt.load_checkpoint(latest_checkpoint(cfg.run_dir)).step == 2
    assert hidden(cfg.run_dir) == []


def test_an_abort_write_over_its_budget_is_dropped_and_the_run_still_ends_promptly(
        tmp_path, assets, monkeypatch):
    budget = 1.0
    slow = []
    real = safetensors_io._write

    def write(fd, view):  # from the abort on, the disk crawls: ~20 KB/s
        if slow:
            time.sleep(0.05)
        real(fd, view)
    monkeypatch.setattr(safetensors_io, "_write", write)
    cfg = long_config(tmp_path, assets, checkpoint__every=2, checkpoint__abort_budget_s=budget)
    engine = Engine(cfg)

    def crawl():
        monkeypatch.setattr(safetensors_io, "CHUNK", 1024)  # so a cancel is seen soon
        slow.append(1)
    when = abort_at_step_3(monkeypatch, engine, cfg, on_abort=crawl)
    rec = run_to_end(engine)
    engine.shutdown()
    end = rec.of(RunEnded)[0]
    assert end.status == "aborted" and end.step == 3
    # the budget, then the writer is stopped and the run ends (no 5 s waits on a stuck writer)
    assert end.ts - when[0] < budget + 3.0, end.ts - when[0]
    step2 = cfg.run_dir / CHECKPOINTS / "step-2"
    (said,) = [w for w in warnings(rec) if "abort checkpoint of step 3" in w]
    assert said == (f"abort checkpoint of step 3 did not finish within checkpoint.abort_budget_s "
                    f"(1 s); abandoned, the checkpoint at step 2 stands ({step2})")
    assert [(c.step, c.reason) for c in rec.of(Checkpoint)] == [(2, "periodic")]
    assert not rec.of(Error)  # an abandoned write is said once, as above, not as a failure
    assert sorted(p.name for p in (cfg.run_dir / CHECKPOINTS).iterdir()) == ["step-2"]
    assert ckpt.load_checkpoint(latest_checkpoint(cfg.run_dir)).step == 2


def test_an_abort_within_its_budget_is_durable_before_the_run_ends(tmp_path, assets,
                                                                    monkeypatch):
    model_disk(monkeypatch, bytes_per_s=200_000)  # ~0.8 s: within the 25 s budget
    slow = []
    modelled = safetensors_io._write

    def write(fd, view):  # and the abort's write really takes a while (~0.3 s)
        if slow:
            time.sleep(0.002)
        modelled(fd, view)
    monkeypatch.setattr(safetensors_io, "_write", write)
    cfg = long_config(tmp_path, assets, checkpoint__every=2)
    engine = Engine(cfg)

    def crawl():
        monkeypatch.setattr(safetensors_io, "CHUNK", 1024)
        slow.append(1)
    abort_at_step_3(monkeypatch, engine, cfg, on_abort=crawl)
    at_end = []

    def on_end(ev):  # what a process exiting at RunEnded leaves on disk
        if isinstance(ev, RunEnded):
            latest = latest_checkpoint(cfg.run_dir)
            at_end.append(ckpt.load_checkpoint(latest).step if latest is not None else None)
    engine.bus.tap(on_end)
    rec = run_to_end(engine)
    engine.shutdown()
    end = rec.of(RunEnded)[0]
    assert end.status == "aborted" and end.step == 3
    assert at_end == [3]
    assert [(c.step, c.reason) for c in rec.of(Checkpoint)] == [(2, "periodic"), (3, "abort")]
    assert not [w for w in warnings(rec) if "abort_budget_s" in w]
    assert not rec.of(Error)


def writer_processes() -> list:
    return [p for p in multiprocessing.active_children()
            if p.name.startswith("checkpoint-writer") and p.is_alive()]


@pytest.mark.timeout(240)
def test_a_writer_killed_during_a_periodic_checkpoint_is_reported_and_the_run_goes_on(
        tmp_path, assets, monkeypatch):
    # The tiny checkpoints are written by threads unless told otherwise.
    monkeypatch.setattr(checkpointer, "PROCESS_WRITER_BYTES", 0)
    monkeypatch.setattr(async_writer, "writer_main", writer_targets.writer_stuck_at_step_4)
    cfg = long_config(tmp_path, assets, run__max_steps=8, checkpoint__every=2,
                      checkpoint__keep=2)
    engine, rec, before = started(cfg)
    rec.wait_for(lambda e: isinstance(e, CheckpointProgress) and e.step == 4, 120)
    (writer,) = writer_processes()
    os.kill(writer.pid, signal.SIGKILL)
    end = ended(engine, rec, timeout=180)
    assert end.status == "finished" and end.step == 8
    # multiprocessing's resource sharer (it handed the staging arena to the writer processes)
    # serves for the rest of this process: not the engine's
    assert [t for t in wait_gone(before) if not t.endswith("(_serve)")] == []
    # the death, as an Error naming the folder being written and the checkpoint that stands
    errors = rec.of(Error)
    assert len(errors) == 1, [(e.source, e.message) for e in errors]
    (err,) = errors
    tmp = cfg.run_dir / CHECKPOINTS / f".tmp-step-4-{os.getpid()}"
    assert (err.source, err.error_kind, err.fatal) == ("checkpoint", "io", False)
    assert err.message.startswith(f"periodic checkpoint of step 4 could not be written to {tmp}: "
                                  f"writer 0 (pid {writer.pid}) died (killed by SIGKILL)")
    assert err.message.endswith("; the checkpoint at step 2 stands")
    assert "new writer" in err.hint
    # training went on; the next checkpoints were written by a new writer
    after = rec.events[rec.events.index(err):]
    assert [e.step for e in after if isinstance(e, StepMetrics)][-1] == 8
    assert [(c.step, c.reason) for c in rec.of(Checkpoint)] == [(2, "periodic"), (6, "periodic"),
                                                                (8, "periodic")]
    assert sorted(p.name for p in (cfg.run_dir / CHECKPOINTS).iterdir()) == [
        "step-6", "step-8"]
    # and --resume from what it left trains on
    monkeypatch.undo()
    resumed = Engine(long_config(tmp_path, assets, run__max_steps=10, checkpoint__every=2,
                                 checkpoint__keep=2), resume=True)
    rec2 = run_to_end(resumed, timeout=120)
    resumed.shutdown()
    assert rec2.of(RunEnded)[0].status == "finished"
    assert [m.step for m in rec2.of(StepMetrics)] == [9, 10]
    assert ckpt.load_checkpoint(latest_checkpoint(cfg.run_dir)).step == 10
