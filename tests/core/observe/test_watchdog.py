"""Stalls are shown, not guessed: a worker that stops making progress is reported with where its
thread is, the report clears when it goes on, and a stop request ends even a stuck preflight."""

import io
import os
import re
import signal
import threading
import time
import traceback

import pytest

from dflash_core.data import ShardedDataset
from dflash_core.pipeline.engine import Engine
from dflash_core.observe.events import Log, Stall, StepMetrics
from dflash_core.pipeline.headless import run_headless
from dflash_core.models.target.model import TargetModel
from dflash_core.models.training.replica import DrafterReplica
from dflash_core.observe.watchdog import Heartbeats, Watchdog, where

from ..engine_fixtures import Recorder, assets, make_config, run_config  # noqa: F401 - fixture


def frames(*spec):
    return [traceback.FrameSummary(path, line, name) for path, line, name in spec]


OWN = ("/x/dflash_core/pipeline/drafter_stage.py", 70, "_accumulate_step")


@pytest.mark.parametrize("innermost, says", [
    (("/v/site-packages/torch/_inductor/compile_fx.py", 900, "compile_fx"), "compiling"),
    (("/v/site-packages/torch/distributed/distributed_c10d.py", 2800, "all_reduce"),
     "in a collective"),
    (("/v/site-packages/torch/cuda/__init__.py", 1000, "synchronize"), "waiting on the GPU"),
    (("/v/site-packages/pyarrow/ipc.py", 40, "read_all"), "reading"),
    (("/x/dflash_core/checkpoint/save_load.py", 250, "save_checkpoint"), "writing a checkpoint"),
])
def test_where_says_what_a_stack_is_doing(innermost, says):
    text = where(frames(OWN, innermost))
    assert text.startswith(says + ": ")
    # and the innermost frame of the engine's own code
    own = "save_load.py:250 save_checkpoint" if "dflash_core" in innermost[0] \
        else "drafter_stage.py:70 _accumulate_step"
    assert text.endswith(f"({own})")


def test_the_wait_to_join_the_other_nodes_is_in_a_collective():
    # The join's wait loops live in node_join.py, apart from the collectives in nodes.py.
    joining = ("/x/dflash_core/multinode/node_join.py", 290, "_await_joins")
    assert where(frames(OWN, joining)).startswith("in a collective: multinode/node_join.py:290")


def test_where_without_a_known_activity_names_the_innermost_frame():
    assert where(frames(OWN, ("/x/mine.py", 3, "spin"))).startswith("running: ")
    assert where([]) == "unknown"


def test_watchdog_reports_a_silent_worker_once_and_clears_it():
    hb, published, release = Heartbeats(), [], threading.Event()

    def read_that_never_returns():  # a stand-in for a read on a hung network mount
        release.wait(30)

    def worker():
        for _ in range(5):
            hb.beat("reading data")
            time.sleep(0.02)
        read_that_never_returns()
        hb.beat("reading data")
        time.sleep(5)

    t = threading.Thread(target=worker, name="loader-0", daemon=True)
    t.start()
    dog = Watchdog(hb, published.append, threading.Event(), floor_s=0.3)
    time.sleep(0.2)
    dog.check()
    assert published == []  # within its usual rhythm
    time.sleep(0.4)
    dog.check()
    dog.check()  # once per stall, not once per check
    (stall,) = published
    assert (stall.worker, stall.phase, stall.cleared) == ("loader-0", "reading data", False)
    assert stall.seconds > 0.3 and "read_that_never_returns" in stall.stack
    assert "read_that_never_returns" in stall.where
    release.set()
    time.sleep(0.1)
    dog.check()
    assert [s.cleared for s in published] == [False, True]


def _stalled_run(tmp_path, assets, monkeypatch, cls, name, worker, pause_s=2.5):
    original, paused = getattr(cls, name), []

    def slow(self, *args, **kwargs):
        if threading.current_thread().name == worker and not paused:
            paused.append(1)
            time.sleep(pause_s)  # no progress reported meanwhile: a slow forward, a long compile
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, slow)
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=4, data__eval_prompts=0,
                      telemetry__stall_floor_s=1.0)
    end, rec = run_config(cfg)
    return end, rec


@pytest.mark.parametrize("cls, name, worker, phase", [
    (TargetModel, "features", "target-0", "forward"),
    (DrafterReplica, "accumulate", "drafter-0", "training step"),
])
def test_a_slow_worker_is_a_warning_that_clears_and_the_run_goes_on(
        tmp_path, assets, monkeypatch, cls, name, worker, phase):
    end, rec = _stalled_run(tmp_path, assets, monkeypatch, cls, name, worker)
    assert end.status == "finished"  # a stall is never fatal by itself
    mine = [s for s in rec.of(Stall) if s.worker == worker]
    assert [s.cleared for s in mine] == [False, True]
    assert mine[0].phase == phase and "time.sleep" not in mine[0].where
    assert "slow" in mine[0].stack  # the frame it is stuck in
    assert len(rec.of(StepMetrics)) == 4


@pytest.mark.slow  # fast path: test_engine_faults.py's test_abort_during_preflight (in process)
def test_sigterm_ends_a_headless_run_stuck_in_preflight(tmp_path, assets, monkeypatch):
    # Opening the data never returns and ignores the stop flag, as a read on a hung network mount.
    release = threading.Event()

    def hung_open(cls, path):
        release.wait(120)
        raise OSError("the mount came back too late")

    monkeypatch.setattr(ShardedDataset, "open", classmethod(hung_open))
    target, data = assets
    cfg = make_config(tmp_path, target, data, telemetry__stall_floor_s=1.0)
    engine = Engine(cfg)
    out = io.StringIO()
    log = cfg.run_dir / "train.log"

    def operator():  # sees the stall in the log, then asks the process to stop
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                log.exists() and "stalled" in log.read_text(encoding="utf-8")):
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=operator, daemon=True).start()
    try:
        t = time.monotonic()
        code = run_headless(engine, out=out)
        text = log.read_text(encoding="utf-8")
        assert "engine stalled" in text and "in preflight" in text and "hung_open" in text
        assert code == 130
        assert time.monotonic() - t < 60
        assert "exiting without engine (" in out.getvalue()
        assert "hung_open" in out.getvalue()  # where it was stuck
    finally:
        release.set()
        engine.join(30)


def test_stacks_command_publishes_where_every_worker_is(tmp_path, assets):
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=0, optim__epochs=200,
                      data__eval_prompts=0, checkpoint__every=0)
    engine = Engine(cfg)
    rec = Recorder(engine.bus)
    engine.start()
    try:
        rec.wait_for(lambda e: isinstance(e, StepMetrics), 60)
        engine.stacks()
        lines = {e.source: e.message for e in rec.of(Log) if e.message.startswith("stack of ")}
        assert {"engine", "target-0", "drafter-0", "telemetry", "watchdog"} <= set(lines)
        # what it does, then the innermost frame of the engine's own code, then the frames
        first = lines["drafter-0"].splitlines()[0]
        # (a frame's name may be "<lambda>" or "<genexpr>")
        assert re.fullmatch(r"stack of drafter-0: [a-z ]+: .+ \(\S+\.py:\d+ \S+\)", first), first
        assert 'File "' in lines["drafter-0"]
    finally:
        engine.shutdown()
