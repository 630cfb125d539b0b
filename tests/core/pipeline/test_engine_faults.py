"""Faults injected into every worker, aborts from every state, restart leaks.

A fault is a monkeypatched function that raises on its n-th call. Each run must end in the right
terminal state within seconds, say who failed and why (Error kind, source, hint), and leave no
engine thread behind.
"""

import threading
import time

import psutil
import pytest
import torch

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.folders import latest_checkpoint
from dflash_core.data import batching as data_mod
from dflash_core.models.target import model as target_mod
from dflash_core.models.target import load as target_load
from dflash_core.pipeline import target_stage
from dflash_core.observe.events import (
    WORKER_STOPPED, Checkpoint, Error, LoadProgress, Log, QueueDepth, RunEnded, StateChanged,
    StepMetrics, WorkerStatus,
)
from dflash_core.observe.sinks.jsonl import JsonlSink
from dflash_core.observe.sinks.textlog import TextLogSink
from dflash_core.observe.sinks.wandb_sink import WandbSink
from dflash_core.observe.telemetry import TelemetrySampler
from dflash_core.models.training.replica import DrafterReplica

from ..engine_fixtures import (  # noqa: F401 - assets, shutdown_started_engines: fixtures
    FAIL_WITHIN_S, Recorder, assets, ended, long_config, make_config, restart_and_train,
    shutdown_started_engines, started, wait_gone,
)


def oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 30.00 GiB (GPU 0; 139.80 GiB total capacity; "
        "12.00 GiB already allocated)")


def plain() -> RuntimeError:
    return RuntimeError("injected fault")


class Fault:
    """Replaces ``owner.name`` with a wrapper that raises ``make_exc()`` on call ``nth``
    (and passes every other call through); ``at`` is when it first raised and ``last`` when it
    last did (time.time())."""

    def __init__(self, monkeypatch, owner, name: str, make_exc, nth: int = 1,
                 persist: bool = False):
        """``persist``: raise on every call from the nth on (a fault a retry cannot cure)."""
        self.nth, self.calls, self.at, self.last = nth, 0, None, None
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            self.calls += 1
            if self.calls == self.nth or (persist and self.calls > self.nth):
                self.last = time.time()
                self.at = self.at or self.last
                raise make_exc()
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)


def state_time(rec: Recorder, state: str) -> float:
    return rec.wait_for(lambda e: isinstance(e, StateChanged) and e.state == state, 30).ts


# --------------------------------------------------------------------------------------------
# A fault in each worker fails the run
# --------------------------------------------------------------------------------------------

# worker -> (where to inject, which call, Error.source, config key the OOM hint must name)
WORKERS = {
    "loader": (lambda: (data_mod, "collate"), 4, "loader-0", "data.prefetch_batches"),
    "target": (lambda: (target_mod.TargetModel, "features"), 3, "target-0", "data.token_budget"),
    "drafter": (lambda: (DrafterReplica, "accumulate"), 3, "drafter-0",
                "drafter.micro_block_tokens"),
    "telemetry": (lambda: (TelemetrySampler, "sample_once"), 2, "telemetry", None),
    "jsonl": (lambda: (JsonlSink, "__call__"), 20, "sink:jsonl", None),
    "textlog": (lambda: (TextLogSink, "__call__"), 5, "sink:textlog", None),
}
# A sink's exception is classified by the bus (bus._Subscription), which knows io and
# internal only: an OOM inside a sink reads "internal" there (see the report on events.py).
OOM_KIND = {"sink:jsonl": ("oom", "internal"), "sink:textlog": ("oom", "internal")}


@pytest.mark.parametrize("exc", [plain, oom], ids=["exception", "oom"])
@pytest.mark.parametrize("worker", list(WORKERS))
def test_worker_fault_fails_the_run(tmp_path, assets, monkeypatch, worker, exc):
    where, nth, source, oom_key = WORKERS[worker]
    # Drafters and targets back off from an OOM to smaller micro-groups or split batches
    # (tests/core/pipeline/test_drafter_stage.py, test_target_stage.py): only a fault that persists down
    # to a single sequence fails the run.
    fault = Fault(monkeypatch, *where(), exc, nth=nth, persist=worker in ("drafter", "target"))
    engine, rec, before = started(long_config(tmp_path, assets))

    end = ended(engine, rec)
    assert end.status == "failed" and engine.state == "failed"
    assert fault.at is not None
    # From the fault nothing could cure: a persisting OOM first walks the back-off down to one
    # sequence (each rung retries the step, 2-5 s in all on a 2-core machine), which is
    # recovery, not a crash left unsurfaced.
    seconds = state_time(rec, "failed") - fault.last
    assert seconds < FAIL_WITHIN_S
    if exc is oom and worker in ("drafter", "target"):
        assert any("retried" in e.message for e in rec.of(Log) if e.level == "warning")

    fatal = [e for e in rec.of(Error) if e.fatal]
    assert len(fatal) == 1, [(e.source, e.message) for e in rec.of(Error)]
    err = fatal[0]
    assert err.source == source
    if exc is plain:
        assert err.error_kind == "internal" and "injected fault" in err.message
    else:
        assert err.error_kind in OOM_KIND.get(source, ("oom",))
        assert "out of memory" in err.message
        if oom_key:
            assert "30.00 GiB" in err.hint and oom_key in err.hint
    assert err.traceback and "Traceback" in err.traceback
    assert end.reason == err.message
    assert wait_gone(before) == []
    print(f"fault {worker}/{exc.__name__}: {end.status}, {err.error_kind}, {err.source}, "
          f"{seconds:.2f} s")


def test_fault_in_one_of_two_drafters_releases_the_other_from_the_step_barrier(
        tmp_path, assets, monkeypatch):
    calls, raised_at = [], []
    original = DrafterReplica.accumulate

    def accumulate(self, *args, **kwargs):
        if threading.current_thread().name == "drafter-1":
            calls.append(1)
            if len(calls) >= 2:  # persists through the back-off to one sequence per group
                raised_at.append(time.time())
                raise oom()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DrafterReplica, "accumulate", accumulate)
    engine, rec, before = started(long_config(tmp_path, assets, layout__drafters=[0, 1]))
    end = ended(engine, rec)
    assert end.status == "failed" and end.step >= 1
    # From the OOM no back-off could cure (the rungs before it are recovery, not the release)
    assert len(raised_at) > 1
    assert state_time(rec, "failed") - raised_at[-1] < FAIL_WITHIN_S
    (err,) = [e for e in rec.of(Error) if e.fatal]
    assert (err.source, err.error_kind) == ("drafter-1", "oom")
    assert "drafter.micro_block_tokens" in err.hint
    assert wait_gone(before) == []


@pytest.mark.parametrize("exc", [plain, oom], ids=["exception", "oom"])
def test_wandb_sink_fault_does_not_fail_the_run(tmp_path, assets, monkeypatch, exc):
    # On the first event, before wandb.init: starting wandb costs seconds and leaves its threads.
    Fault(monkeypatch, WandbSink, "__call__", exc, nth=1)
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=3, data__eval_prompts=0,
                      wandb__enabled=True, wandb__mode="offline")
    engine, rec, before = started(cfg)
    end = ended(engine, rec, 60)
    assert end.status == "finished"
    (err,) = rec.of(Error)
    assert err.source == "sink:wandb" and not err.fatal
    assert "goes on without it" in err.hint
    assert [m.step for m in rec.of(StepMetrics)] == [1, 2, 3]
    assert wait_gone(before) == []


# --------------------------------------------------------------------------------------------
# Abort from every state
# --------------------------------------------------------------------------------------------

def stop_aware_wait(engine_box: list, entered: threading.Event, limit_s: float = 30.0) -> None:
    """What a slow, well-behaved step does: work in slices, re-checking the stop flag."""
    entered.set()
    deadline = time.monotonic() + limit_s
    while not engine_box[0].stopping and time.monotonic() < deadline:
        time.sleep(0.02)


def assert_aborted_quickly(engine, rec, before, t_abort: float, *, checkpoint: bool):
    end = ended(engine, rec)
    assert end.status == "aborted" and engine.state == "aborted"
    assert state_time(rec, "aborted") - t_abort < FAIL_WITHIN_S
    assert not rec.of(Error), [(e.source, e.message) for e in rec.of(Error)]
    assert wait_gone(before) == []
    # Every worker that said anything says how it ended, before the run's end: none is left
    # "running" on the screen or in train.log (a target parked in a full queue's wait included).
    last = {}
    for e in rec.events:
        if isinstance(e, WorkerStatus):
            last[e.worker] = e.status
        elif isinstance(e, StateChanged) and e.state == "aborted":
            break
    assert all(s == WORKER_STOPPED for s in last.values()), last
    if any(isinstance(e, StepMetrics) for e in rec.events):
        assert {"target-0", "drafter-0"} <= set(last), last
    saved = rec.of(Checkpoint)
    if checkpoint:
        assert end.step >= 1
        assert [c.reason for c in saved] == ["abort"] and saved[0].step == end.step
        latest = latest_checkpoint(engine.config.run_dir)
        assert latest is not None and ckpt.load_checkpoint(latest).step == end.step
    else:
        assert end.step == 0 and not saved


def test_abort_right_after_start_is_not_lost(tmp_path, assets):
    # start() returns before the supervisor has left "idle": the abort must still count.
    engine, rec, before = started(long_config(tmp_path, assets))
    t = time.time()
    engine.abort()
    assert_aborted_quickly(engine, rec, before, t, checkpoint=False)
    # Not lost: the run never trains. Where it stops depends on when the abort lands: before the
    # supervisor's first check (preflight -> aborted) or, on a busy machine, once the tiny
    # preflight is over (preflight -> loading -> aborted).
    states = rec.states()
    assert states[0] == "preflight" and states[-1] == "aborted", states
    assert set(states) <= {"preflight", "loading", "aborted"}, states


def test_abort_during_preflight(tmp_path, assets, monkeypatch):
    box, entered = [], threading.Event()
    original = data_mod.ShardedDataset.open.__func__

    def slow_open(cls, path):
        stop_aware_wait(box, entered)
        return original(cls, path)

    monkeypatch.setattr(data_mod.ShardedDataset, "open", classmethod(slow_open))
    engine, rec, before = started(long_config(tmp_path, assets))
    box.append(engine)
    assert entered.wait(30)
    t = time.time()
    engine.abort()
    assert_aborted_quickly(engine, rec, before, t, checkpoint=False)
    assert rec.states() == ["preflight", "aborted"]


def test_abort_during_loading(tmp_path, assets, monkeypatch):
    # The real loader, made slow: small reads, a progress report after each, each report slow.
    monkeypatch.setattr(target_load, "_READ_CHUNK", 4096)
    monkeypatch.setattr(target_load, "_REPORT_EVERY_S", 0.0)
    original = target_stage.load_target

    def slow_load(*args, progress=None, **kwargs):
        def slow_progress(**fields):
            progress(**fields)
            time.sleep(0.05)
        return original(*args, progress=slow_progress, **kwargs)

    monkeypatch.setattr(target_stage, "load_target", slow_load)
    engine, rec, before = started(long_config(tmp_path, assets))
    rec.wait_for(lambda e: isinstance(e, LoadProgress) and e.bytes_loaded > 0, 30)
    t = time.time()
    engine.abort()
    assert_aborted_quickly(engine, rec, before, t, checkpoint=False)
    assert rec.states() == ["preflight", "loading", "aborted"]
    assert not any(p.done for p in rec.of(LoadProgress))


def test_abort_during_warmup(tmp_path, assets, monkeypatch):
    box, entered = [], threading.Event()
    original = DrafterReplica.accumulate

    def slow_first_step(self, *args, **kwargs):  # kernel compilation on the first step
        stop_aware_wait(box, entered)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DrafterReplica, "accumulate", slow_first_step)
    engine, rec, before = started(long_config(tmp_path, assets))
    box.append(engine)
    assert entered.wait(30)
    t = time.time()
    engine.abort()
    assert_aborted_quickly(engine, rec, before, t, checkpoint=False)
    assert rec.states() == ["preflight", "loading", "warmup", "aborted"]


def test_abort_during_training_writes_a_checkpoint(tmp_path, assets):
    engine, rec, before = started(long_config(tmp_path, assets))
    rec.wait_for(lambda e: isinstance(e, StepMetrics) and e.step >= 2, 30)
    t = time.time()
    engine.abort()
    assert_aborted_quickly(engine, rec, before, t, checkpoint=True)
    assert rec.states() == ["preflight", "loading", "warmup", "training", "aborted"]


def test_abort_with_target_blocked_on_a_full_hs_queue(tmp_path, assets, monkeypatch):
    original = DrafterReplica.accumulate

    def slow_drafter(self, *args, **kwargs):
        time.sleep(0.3)  # not stop-aware: one micro-group of a real step is not either
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DrafterReplica, "accumulate", slow_drafter)
    engine, rec, before = started(long_config(tmp_path, assets))
    rec.wait_for(lambda e: isinstance(e, StepMetrics), 30)
    rec.wait_for(lambda e: isinstance(e, QueueDepth) and e.name == "hs" and e.depth == e.capacity,
                 30)
    time.sleep(0.3)  # the target is now parked in its put
    assert engine.hs_queue.depth() == engine.hs_queue.capacity
    t = time.time()
    engine.abort()
    assert_aborted_quickly(engine, rec, before, t, checkpoint=True)


def test_abort_with_drafter_blocked_on_an_empty_hs_queue(tmp_path, assets, monkeypatch):
    original = target_mod.TargetModel.features

    def slow_target(self, *args, **kwargs):
        time.sleep(0.5)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(target_mod.TargetModel, "features", slow_target)
    engine, rec, before = started(long_config(tmp_path, assets))
    rec.wait_for(lambda e: isinstance(e, StepMetrics), 30)
    time.sleep(0.1)  # the drafter is now waiting for the next batch
    assert engine.hs_queue.depth() == 0
    t = time.time()
    engine.abort()
    assert_aborted_quickly(engine, rec, before, t, checkpoint=True)


def test_abort_inside_a_long_target_forward_waits_for_one_layer(tmp_path, assets, monkeypatch):
    # A 27B forward of a 64K-token batch takes ~7 s, longer than the join timeout: the target
    # must stop between layers, not after the whole forward.
    from transformers.models.qwen3 import modeling_qwen3

    original, inside = modeling_qwen3.Qwen3DecoderLayer.forward, threading.Event()

    def slow_layer(self, *args, **kwargs):
        if threading.current_thread().name.startswith("target"):
            inside.set()
            time.sleep(1.5)  # six layers: 9 s a forward
        return original(self, *args, **kwargs)

    monkeypatch.setattr(modeling_qwen3.Qwen3DecoderLayer, "forward", slow_layer)
    engine, rec, before = started(long_config(tmp_path, assets))
    assert inside.wait(30)
    t = time.time()
    engine.abort()
    assert_aborted_quickly(engine, rec, before, t, checkpoint=False)
    assert state_time(rec, "aborted") - t < 3.0  # one layer (1.5 s), not the forward (9 s)
    assert not [e for e in rec.of(Log) if "waiting for" in e.message]


def test_abort_inside_a_long_drafter_step_waits_for_one_micro_group(tmp_path, assets,
                                                                    monkeypatch):
    # One micro-group per sample; once a step has landed, every group takes 1.5 s.
    from dflash_core.models import objective

    original, slow, inside = objective.chunked_loss, threading.Event(), threading.Event()

    def slow_loss(*args, **kwargs):
        if slow.is_set():
            inside.set()
            time.sleep(1.5)
        return original(*args, **kwargs)

    monkeypatch.setattr(objective, "chunked_loss", slow_loss)
    engine, rec, before = started(long_config(tmp_path, assets, drafter__micro_block_tokens=32,
                                              data__max_seqs_per_batch=4))
    rec.wait_for(lambda e: isinstance(e, StepMetrics) and e.step >= 1, 30)
    slow.set()
    assert inside.wait(30)
    t = time.time()
    engine.abort()
    assert_aborted_quickly(engine, rec, before, t, checkpoint=True)
    assert state_time(rec, "aborted") - t < 3.5  # one group (1.5 s) + the checkpoint


def test_no_checkpoint_while_a_drafter_that_ignores_stop_is_still_running(tmp_path, assets,
                                                                          monkeypatch):
    import dflash_core.pipeline.supervisor as supervisor_mod

    monkeypatch.setattr(supervisor_mod, "GIVE_UP_S", 1.0)
    original, stuck, release = DrafterReplica.accumulate, threading.Event(), threading.Event()

    def stuck_step(self, *args, **kwargs):  # a hung kernel: deaf to the stop flag
        if stuck.is_set():
            release.wait(30)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DrafterReplica, "accumulate", stuck_step)
    engine, rec, before = started(long_config(tmp_path, assets))
    rec.wait_for(lambda e: isinstance(e, StepMetrics) and e.step >= 1, 30)
    stuck.set()
    time.sleep(0.5)  # the drafter is now inside its next step
    engine.abort()
    end = ended(engine, rec)
    assert end.status == "aborted"
    assert not rec.of(Checkpoint)  # weights the stuck step may still change are never saved
    assert [e for e in rec.of(Log) if "no abort checkpoint" in e.message]
    assert [e for e in rec.of(Log) if "still running after 1 s" in e.message]
    engine.start()  # refused while the old drafter lives: two pipelines must never run
    rec.wait_for(lambda e: isinstance(e, Error) and "still running" in e.message, 10)
    release.set()
    assert wait_gone(before) == []


# --------------------------------------------------------------------------------------------
# Restart, again and again: no thread and no memory left behind
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("restarts", [5, pytest.param(20, marks=pytest.mark.slow)])
def test_restarts_leak_no_threads_and_no_memory(tmp_path, assets, restarts):
    engine, rec, before = started(long_config(tmp_path, assets, checkpoint__keep=1))
    proc = psutil.Process()
    rec.wait_for(lambda e: isinstance(e, StepMetrics), 30)
    restart_and_train(engine, rec)  # warm-up: first-use allocations and imports are not leaks
    threads0, rss0 = len(threading.enumerate()), proc.memory_info().rss
    for _ in range(restarts):
        restart_and_train(engine, rec)
    assert len(threading.enumerate()) <= threads0, [t.name for t in threading.enumerate()]
    grown = proc.memory_info().rss - rss0
    # Inside a long test process the arenas other tests made stay (pipeline/host_memory.py caps
    # only the ones made after the engine starts): the limit of a shared process, not of a run's.
    assert grown < 200 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB over {restarts} restarts"

    ends = rec.of(RunEnded)
    assert [e.status for e in ends] == ["aborted"] * (restarts + 1)
    assert all(e.step >= 1 for e in ends)
    # each restart resumed from the abort checkpoint of the run before it
    assert [e.step for e in ends] == sorted(e.step for e in ends)
    assert all(c.reason == "abort" for c in rec.of(Checkpoint))

    engine.shutdown()
    assert engine.state == "aborted"
    assert wait_gone(before) == []
