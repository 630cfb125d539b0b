"""Target groups' faults (robustness round six): two groups at once, each its own world and
nothing listening beyond the loopback; a group that does not form names how many ranks came; a
rank that hangs is its worker's stall and an abort still ends the run and every rank."""

import os
import queue
import signal
import threading
import time

import psutil
import pytest
import torch

from dflash_core.observe.events import RunEnded, Stall
from dflash_core.pipeline.engine import Engine
from dflash_core.target_group.group import STOP_GRACE_S, TargetGroup
from dflash_core.target_group.rank import GroupFormError, form
from dflash_core.target_group.split import GroupSplit

from ..engine_fixtures import Recorder, assets, make_config  # noqa: F401 - assets: a fixture
from .group_harness import reply, start_group, wait_loaded

GROUP = dict(layout__targets=[0, 1], target__gpus_per_copy=2)


@pytest.mark.slow
def test_two_groups_at_once_each_form_their_own_world_on_the_loopback(assets, tmp_path):
    target, _ = assets
    groups = [start_group(target, "sharded", False, tmp_path / f"run{i}") for i in range(2)]
    try:
        for g in groups:
            wait_loaded(g)
        listening = [c.laddr.ip for g in groups for p in g.procs
                     for c in psutil.Process(p.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and set(listening) <= {"127.0.0.1", "::1"}, listening
        ids = torch.randint(0, 100, (2, 16))
        for i, g in enumerate(groups):
            for r in range(2):
                g.requests[r].put(("batch", 1, ids, torch.ones_like(ids)))
        for g in groups:
            for r in range(2):
                assert reply(g, r, ("features",))[2].shape[:2] == (2, 16)
    finally:
        for g in groups:
            g.shutdown()


def test_a_group_that_does_not_form_names_how_many_ranks_came(tmp_path):
    store = torch.distributed.FileStore(str(tmp_path / "store"), 2)
    t0 = time.monotonic()
    with pytest.raises(GroupFormError) as err:
        form(store, 0, 2, timeout_s=0.5)
    assert "rank 0: the group did not form within 0 s: 1 of 2 ranks joined" in str(err.value)
    assert time.monotonic() - t0 < 5 and err.value.hint


def _abort_ends_every_rank(engine, rec, pids) -> None:
    """An abort ends the run (aborted, within 20 s) and every rank's process."""
    t0 = time.monotonic()
    threading.Thread(target=engine.abort, daemon=True).start()
    ended = rec.wait_for(lambda e: isinstance(e, RunEnded), 60)
    took = time.monotonic() - t0
    engine.shutdown()
    assert ended.status == "aborted" and took < 20, took
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


@pytest.mark.slow
def test_a_hung_rank_is_a_stall_and_an_abort_still_ends_every_rank(assets, tmp_path):
    target, data = assets
    cfg = make_config(tmp_path, target, data, data__eval_prompts=0, run__max_steps=0,
                      optim__epochs=200, checkpoint__every=0, telemetry__stall_floor_s=1.0,
                      **GROUP)
    engine = Engine(cfg)
    rec = Recorder(engine.bus)
    engine.start()
    rec.wait_for(lambda e: getattr(e, "state", "") == "training", 120)
    pids = [p.pid for g in engine._run.groups for p in g.procs]
    assert len(pids) == 2
    os.kill(pids[1], signal.SIGSTOP)  # no progress, no exit
    stall = rec.wait_for(lambda e: isinstance(e, Stall) and not e.cleared, 60)
    assert stall.worker.startswith("target-")
    _abort_ends_every_rank(engine, rec, pids)


class _HandOverHang:
    """A reply queue whose next get waits as a CPU tensor's fd handover from a stopped rank does:
    no timeout honoured, broken only when the rank ends (then: connection reset)."""

    def __init__(self, q, pid: int):
        self.q, self.pid = q, pid
        self.waiting = threading.Event()

    def _alive(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def get(self, timeout=None):
        self.waiting.set()
        while self._alive():
            time.sleep(0.05)
        raise ConnectionResetError(104, "Connection reset by peer")

    def get_nowait(self):
        raise queue.Empty

    def __getattr__(self, name):
        return getattr(self.q, name)


@pytest.mark.slow
def test_an_abort_ends_a_stream_stuck_in_a_handover_from_a_hung_rank(assets, tmp_path):
    """SIGSTOP between a rank's put and its fd handover leaves the stream in a get that
    ignores its timeout (CI saw the abort wait the full give-up time): the teardown ends the
    ranks, which breaks the wait, instead of waiting on the stream first."""
    target, data = assets
    cfg = make_config(tmp_path, target, data, data__eval_prompts=0, run__max_steps=0,
                      optim__epochs=200, checkpoint__every=0, **GROUP)
    engine = Engine(cfg)
    rec = Recorder(engine.bus)
    engine.start()
    rec.wait_for(lambda e: getattr(e, "state", "") == "training", 120)
    group = engine._run.groups[0]
    pids = [p.pid for p in group.procs]
    hang = _HandOverHang(group.replies[1], pids[1])
    group.replies[1] = hang
    assert hang.waiting.wait(30)
    _abort_ends_every_rank(engine, rec, pids)
    assert not [e for e in rec.events if getattr(e, "fatal", False)]


def test_the_rendezvous_files_of_engines_no_longer_alive_are_removed(tmp_path):
    """An engine killed (SIGKILL) cannot remove its group's rendezvous file; the next group
    started in that run folder does, and leaves a live engine's alone."""
    import subprocess
    import sys

    from dflash_core.target_group.group import STORE_PREFIX, remove_stale_stores

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = tmp_path / f"{STORE_PREFIX}0-{int(gone.stdout)}-123"
    alive = tmp_path / f"{STORE_PREFIX}0-{os.getpid()}-456"
    other = tmp_path / f"{STORE_PREFIX}notes"
    for p in (dead, alive, other):
        p.write_text("x")
    assert remove_stale_stores(tmp_path) == [dead]
    assert not dead.exists() and alive.exists() and other.exists()


@pytest.mark.parametrize("when", [pytest.param("loaded", marks=pytest.mark.slow), "mid-stream",
                                  pytest.param("stream over", marks=pytest.mark.slow)])
def test_ranks_asked_to_stop_end_at_once_and_nothing_is_forced(assets, tmp_path, when):
    """A clean stop or restart must not need the terminate/kill fallback (it warned on every
    stop while the ranks' interpreter teardown took seconds), nor leave the ranks' semaphores
    to the resource tracker."""
    target, _ = assets
    group = start_group(target, "sharded", False, tmp_path)
    wait_loaded(group)
    if when != "loaded":
        ids = torch.randint(0, 100, (2, 16))
        for r in range(2):
            group.requests[r].put(("batch", 0, ids, torch.ones_like(ids)))
        for r in range(2):
            reply(group, r, ("features",))
    if when == "stream over":
        for r in range(2):
            group.requests[r].put(("end",))
        for r in range(2):
            reply(group, r, ("done",))
    t0 = time.monotonic()
    forced = group.shutdown()
    took = time.monotonic() - t0
    assert forced == [] and [p.exitcode for p in group.procs] == [0, 0]
    assert took < STOP_GRACE_S / 2, took
    logs = [group.log_path(r).read_text() for r in range(2)]
    assert not any("leaked semaphore" in text or "Traceback" in text for text in logs), logs


def test_the_rank_killed_by_a_signal_is_named_before_those_that_then_failed(tmp_path):
    """Its peers fail in their collectives and exit 1, perhaps first: the killed one is the
    cause, and the error carries its rank (the screen's row is that rank's)."""
    from types import SimpleNamespace

    group = TargetGroup(0, [torch.device("cpu")] * 3, GroupSplit(3, "sharded", True),
                        target_path=tmp_path, dtype="float32", attn_implementation="sdpa",
                        layer_ids=[1], last_hidden=False, trust_remote_code=False,
                        distributed={}, run_dir=tmp_path, publish=lambda e: None)
    group.procs = [SimpleNamespace(exitcode=1, pid=11), SimpleNamespace(exitcode=None, pid=12),
                   SimpleNamespace(exitcode=-signal.SIGKILL, pid=13)]
    dead = group.dead_rank()
    assert dead.rank == 2 and "rank 2 (cpu:0.2, pid 13) killed by SIGKILL" in str(dead)
    assert dead.error_kind == "oom"
    group.procs[2].exitcode = None
    assert group.dead_rank().rank == 0 and "exited with code 1" in str(group.dead_rank())
