"""Several nodes on one CPU machine: two processes joined by gloo over 127.0.0.1 play two nodes.

Launched by torchrun itself (one machine, two processes: each process is a node) or by setting
the variables torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) on two plain processes:
killing one of those leaves the other alone, where torchrun's agent would stop it too. A node
that must misbehave (a slow checkpoint, a stuck step) runs through a small launcher script that
patches one function before the CLI's main: the engine carries no hooks for tests.
"""

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.folders import list_checkpoints
from dflash_core.config import ConfigError, NodesConfig
from dflash_core.observe.events import Error, Log, NodeStatus, RunEnded, StepMetrics
from dflash_core.observe.event_log import read_events
from dflash_core.multinode.node_link import NodeLink, NodeMismatch, weights_checksum
from dflash_core.checkpoint.resume import check_resume_nodes

from ..engine_fixtures import assets, make_config, run_config, write_config  # noqa: F401

ROOT = Path(__file__).resolve().parents[3]
LOSS_RTOL = 1e-4  # float32 sums in another order (per node, then across) differ in the 6th digit
EXIT_WITHIN_S = 20.0  # from the abort or the kill to the surviving process's exit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(rank: int, world: int, port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def start_nodes(cfg_path: Path, tmp: Path, world: int = 2, *, configs: dict | None = None,
                launchers: dict | None = None, port: int | None = None) -> list[subprocess.Popen]:
    """One process per node. ``configs``: another config file for some nodes; ``launchers``: a
    script for some nodes that patches the engine, then runs the CLI (``launcher``); ``port``:
    where node 0 serves the store (a free one by default)."""
    port = port or free_port()
    procs = []
    for rank in range(world):
        out = open(tmp / f"node{rank}.out", "w")
        path = (configs or {}).get(rank, cfg_path)
        script = (launchers or {}).get(rank)
        head = [sys.executable, str(script)] if script else [sys.executable, "-m", "dflash_tui.cli"]
        procs.append(subprocess.Popen(
            head + ["--headless", "--config", str(path)],
            env=node_env(rank, world, port), stdout=out, stderr=subprocess.STDOUT, cwd=tmp))
    return procs


def launcher(tmp: Path, name: str, patch: str) -> Path:
    """A script that runs ``patch`` (Python, before any run starts), then the CLI."""
    path = tmp / f"{name}.py"
    path.write_text(patch + "\nimport sys\nfrom dflash_tui.cli import main\nsys.exit(main())\n")
    return path


def outputs(tmp: Path, world: int = 2) -> list[str]:
    return [(tmp / f"node{k}.out").read_text()[-3000:] for k in range(world)]


def wait_for_step(events: Path, step: int, procs, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if events.exists() and any(isinstance(e, StepMetrics) and e.step >= step
                                   for e in read_events(events)):
            return
        assert all(p.poll() is None for p in procs), "a node ended before training"
        time.sleep(0.2)
    raise AssertionError(f"no step {step} in {events} within {timeout} s")


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:  # a failing test must not leave nodes behind
        if p.poll() is None:
            p.kill()
            p.wait(10)


def node_config(tmp_path, assets, **over):
    target, data = assets
    base = {"run__max_steps": 0, "data__eval_prompts": 0, "checkpoint__every": 0,
            "nodes__timeout_s": 15.0, "nodes__checksum_every": 2, "telemetry__interval_s": 1.0}
    return make_config(tmp_path, target, data, **{**base, **over})


def losses(events) -> list[tuple[int, float, int]]:
    return [(m.step, m.loss, m.samples) for m in events if isinstance(m, StepMetrics)]


# --------------------------------------------------------------------------------------------
# Two nodes train as one
# --------------------------------------------------------------------------------------------

@pytest.mark.slow  # fast path: test_demo_nodes.py, two nodes training in one folder
def test_two_nodes_under_torchrun_match_one_node_with_the_same_global_batch(tmp_path, assets):
    """2 nodes x 1 drafter against 1 node x 2 drafters: the same batches meet in each step (node
    k takes global batches k, k+2, ...; one node's two drafters take consecutive ones)."""
    cfg = node_config(tmp_path, assets)
    path = write_config(tmp_path / "config.yaml", cfg)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "dflash_tui.cli",
         "--headless", "--config", str(path)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    one = node_config(tmp_path, assets, run__name="one", layout__drafters=[0, 1])
    end, rec = run_config(one)
    assert end.status == "finished"
    want = losses(rec.events)

    run_dir = cfg.run_dir
    for k in (0, 1):
        got = losses(read_events(run_dir / f"node-{k}" / "events.jsonl"))
        assert [s for s, _, _ in got] == [s for s, _, _ in want]
        assert [n for _, _, n in got] == [n for _, _, n in want]  # global samples per step
        assert [x for _, x, _ in got] == pytest.approx([x for _, x, _ in want], rel=LOSS_RTOL)
    assert sum(n for _, _, n in want) == 64  # every sample once (one epoch, none held out)

    # node 0 alone writes checkpoints and the run's config; it shows both nodes' summaries
    assert [p.name for p in list_checkpoints(run_dir)] == [f"step-{want[-1][0]}"]
    assert (run_dir / "config.yaml").exists() and not (run_dir / "node-1" / "config.yaml").exists()
    shown = {e.node for e in read_events(run_dir / "node-0" / "events.jsonl")
             if isinstance(e, NodeStatus)}
    assert shown == {0, 1}
    final = ckpt.load_checkpoint(list_checkpoints(run_dir)[-1])
    assert final.trainer_state["nodes"] == 2


@pytest.mark.slow  # the fast path: test_demo.py, nodes installing the target at once
def test_two_nodes_share_one_run_folder_with_the_demo_target(tmp_path, demo_data, procs):
    """The demo's config with a fixed run.name on two nodes of one shared folder: both install
    the demo target into runs/mn/target at once, each writes its records in node-K/, node 0
    alone the shared files; both train and end together."""
    from dflash_core.demo import META_NAME, demo_config

    cfg = demo_config(output_dir=str(tmp_path / "runs"), name="mn", device="cpu")
    cfg.run.max_steps, cfg.data.eval_prompts, cfg.checkpoint.every = 1, 0, 0
    cfg.nodes.timeout_s = 60.0
    procs += start_nodes(write_config(tmp_path / "config.yaml", cfg), tmp_path)
    codes = [p.wait(240) for p in procs]
    assert codes == [0, 0], outputs(tmp_path)
    run_dir = cfg.run_dir
    assert (run_dir / "target" / META_NAME).is_file()
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) == []
    for k in (0, 1):
        ended = [e for e in read_events(run_dir / f"node-{k}" / "events.jsonl")
                 if isinstance(e, RunEnded)]
        assert [(e.status, e.step) for e in ended] == [("finished", 1)]
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-1"]  # node 0's
    assert not (run_dir / "node-1" / "config.yaml").exists()


SLOW_CHECKPOINT = """
import time
from dflash_core.checkpoint import save_load as checkpoint
_save = checkpoint.save_checkpoint
_slow = [1.5]
def save_checkpoint(*a, **kw):
    time.sleep(_slow.pop() if _slow else 0.0)  # the first: the restart's checkpoint
    return _save(*a, **kw)
checkpoint.save_checkpoint = save_checkpoint
"""


@pytest.mark.slow  # the fast path: test_a_restart_on_another_node_restarts_this_one (the link)
def test_restart_on_node_0_restarts_every_node_from_its_checkpoint(tmp_path, assets, procs):
    """r on node 0 (its command inbox, as an attached dashboard sends it): both nodes stop at the
    same step boundary, node 0 writes the checkpoint, both resume from it and train the rest of
    the run in step, with the losses of one uninterrupted node."""
    from dflash_core.observe.events import RunStarted
    from dflash_core.pipeline.inbox import send_command

    cfg = node_config(tmp_path, assets, optim__epochs=3)
    # Node 0's checkpoint takes a while: node 1 must not resume before it is written.
    slow = launcher(tmp_path, "slow_checkpoint", SLOW_CHECKPOINT)
    procs += start_nodes(write_config(tmp_path / "config.yaml", cfg), tmp_path,
                         launchers={0: slow})
    node0 = cfg.run_dir / "node-0" / "events.jsonl"
    wait_for_step(node0, 2, procs)
    send_command(cfg.run_dir / "node-0", "restart")
    codes = [p.wait(90) for p in procs]
    assert codes == [0, 0], outputs(tmp_path)

    events = [read_events(cfg.run_dir / f"node-{k}" / "events.jsonl") for k in (0, 1)]
    for ev in events:
        assert [e.status for e in ev if isinstance(e, RunEnded)] == ["aborted", "finished"]
        assert len([e for e in ev if isinstance(e, RunStarted)]) == 2
    stopped = [[e for e in ev if isinstance(e, RunEnded)][0].step for ev in events]
    assert stopped[0] == stopped[1] > 0  # the same step boundary on both
    got = [losses(ev) for ev in events]
    assert got[0] == got[1]  # the same steps, samples and losses on both nodes
    steps = [s for s, _, _ in got[0]]
    assert steps == list(range(1, steps[-1] + 1))  # resumed right after the stop, none twice

    one = node_config(tmp_path, assets, run__name="one", layout__drafters=[0, 1], optim__epochs=3)
    end, rec = run_config(one)
    want = losses(rec.events)
    assert [s for s, _, _ in got[0]] == [s for s, _, _ in want]
    assert [x for _, x, _ in got[0]] == pytest.approx([x for _, x, _ in want], rel=LOSS_RTOL)


# --------------------------------------------------------------------------------------------
# Stopping: an abort on node 0, a node killed
# --------------------------------------------------------------------------------------------

def two_nodes_training(tmp_path, assets, procs):
    """Two nodes started on a long run, both past step 2: their config."""
    cfg = node_config(tmp_path, assets, optim__epochs=200)
    procs += start_nodes(write_config(tmp_path / "config.yaml", cfg), tmp_path)
    wait_for_step(cfg.run_dir / "node-0" / "events.jsonl", 2, procs)
    return cfg


@pytest.mark.slow  # fast path: test_killed_node_surfaces_on_node_0... (node 0 stops both, checkpoint)
def test_abort_on_node_0_ends_both_nodes_with_a_checkpoint(tmp_path, assets, procs):
    cfg = two_nodes_training(tmp_path, assets, procs)
    t = time.monotonic()
    procs[0].send_signal(signal.SIGTERM)  # headless: abort, as the dashboard's a does
    codes = [p.wait(EXIT_WITHIN_S) for p in procs]
    assert time.monotonic() - t < EXIT_WITHIN_S
    assert codes == [130, 130], [(tmp_path / f"node{k}.out").read_text()[-2000:] for k in (0, 1)]
    ends = [[e for e in read_events(cfg.run_dir / f"node-{k}" / "events.jsonl")
             if isinstance(e, RunEnded)][-1] for k in (0, 1)]
    assert [e.status for e in ends] == ["aborted", "aborted"]
    assert ends[0].step == ends[1].step  # both stopped at the same step boundary
    assert [p.name for p in list_checkpoints(cfg.run_dir)] == [f"step-{ends[0].step}"]


def test_killed_node_surfaces_on_node_0_which_stops_with_a_checkpoint(tmp_path, assets, procs):
    cfg = two_nodes_training(tmp_path, assets, procs)
    node0 = cfg.run_dir / "node-0" / "events.jsonl"
    t = time.monotonic()
    procs[1].kill()
    code = procs[0].wait(EXIT_WITHIN_S)
    took = time.monotonic() - t
    out = (tmp_path / "node0.out").read_text()
    assert code == 1, out[-3000:]
    assert took < 10.0, f"node 0 took {took:.1f} s to stop"  # far below nodes.timeout_s 15
    events = read_events(node0)
    fatal = [e for e in events if isinstance(e, Error) and e.fatal]
    assert fatal and fatal[0].error_kind == "node" and "node 1 is gone" in fatal[0].message
    end = [e for e in events if isinstance(e, RunEnded)][-1]
    assert end.status == "failed"
    assert [p.name for p in list_checkpoints(cfg.run_dir)] == [f"step-{end.step}"]
    assert "node 1 is gone" in out


STUCK_S = 10.0  # node 1's stuck step: past node 0's nodes.timeout_s and its report
STUCK_NODE_1 = f"""
import pathlib, time
from dflash_core.pipeline import run
_step_once = run.Run.step_once
def step_once(self, *a, **kw):
    if self.step == 2 and not pathlib.Path("stuck").exists():
        pathlib.Path("stuck").write_text("")
        time.sleep({STUCK_S})
    return _step_once(self, *a, **kw)
run.Run.step_once = step_once
"""


@pytest.mark.slow  # the fast path: a killed node (test_killed_node_surfaces_on_node_0...)
def test_a_node_stuck_before_the_step_exchange_is_named_then_fails_node_0(tmp_path, assets,
                                                                          procs):
    """Node 1's stepping thread hangs before step 3's exchange (its process lives on): node 0
    says soon after telemetry.stall_floor_s that it waits on node 1 in a collective, then fails
    after nodes.timeout_s naming node 1, with its checkpoint; node 1 ends when it wakes."""
    from dflash_core.observe.events import Log, Stall

    timeout, floor = 6.0, 2.0
    cfg = node_config(tmp_path, assets, optim__epochs=200, nodes__timeout_s=timeout,
                      telemetry__stall_floor_s=floor)
    procs += start_nodes(write_config(tmp_path / "config.yaml", cfg), tmp_path,
                         launchers={1: launcher(tmp_path, "stuck", STUCK_NODE_1)})
    node0 = cfg.run_dir / "node-0" / "events.jsonl"
    deadline = time.monotonic() + 60
    while not (tmp_path / "stuck").exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            outputs(tmp_path)
        time.sleep(0.1)
    t0 = time.monotonic()

    def stalls():
        return [e for e in read_events(node0) if isinstance(e, Stall) and not e.cleared
                and e.worker.startswith("drafter") and "in a collective" in e.where]
    while not stalls():
        assert time.monotonic() - t0 < floor + 5, "no Stall in a collective on node 0"
        time.sleep(0.2)
    assert "node 1" in stalls()[0].where, stalls()[0]

    code = procs[0].wait(timeout + 10)
    took = time.monotonic() - t0
    assert code == 1, outputs(tmp_path)
    assert timeout <= took + 1, f"node 0 gave up after {took:.1f} s, before nodes.timeout_s"
    events = read_events(node0)
    waits = [e for e in events if isinstance(e, Log) and "waiting" in e.message
             and "node 1" in e.message and "in a collective" in e.message]
    assert waits, "no log line naming node 1"
    fatal = [e for e in events if isinstance(e, Error) and e.fatal]
    assert fatal and fatal[0].error_kind == "node", fatal
    assert "node 1 did not reach the step-boundary exchange" in fatal[0].message
    end = [e for e in events if isinstance(e, RunEnded)][-1]
    assert end.status == "failed" and end.step == 2
    assert [p.name for p in list_checkpoints(cfg.run_dir)] == ["step-2"]
    # node 1 wakes, finds node 0 gone and ends too
    assert procs[1].wait(STUCK_S + 15) == 1, outputs(tmp_path)


# --------------------------------------------------------------------------------------------
# A node that fails before it joins
# --------------------------------------------------------------------------------------------

# node 1 refused is the slow variant; node 0 refused stays the fast path
@pytest.mark.parametrize("bad, why", [pytest.param(1, "config", marks=pytest.mark.slow),
                                      (0, "folder")])
def test_a_node_refused_before_joining_fails_the_other_at_once(tmp_path, assets, procs, bad,
                                                               why):
    """Node ``bad`` is refused before it joins, on its own: node 1 by the CLI (its config.yaml
    has a bad value), node 0 by the engine's preflight (the run folder holds an earlier run's
    train.log; node 0 serves the store, so it stays until node 1 came and read why). It exits 2
    and the other fails at once naming it and its cause, not after nodes.timeout_s."""
    # A long timeout, so that starting two processes on a loaded machine (tens of seconds) is
    # far from it: the other node must fail long before it.
    cfg = node_config(tmp_path, assets, nodes__timeout_s=180.0)
    good = write_config(tmp_path / "config.yaml", cfg)
    configs = {}
    if why == "config":
        wrong = tmp_path / "config-bad.yaml"
        wrong.write_text(good.read_text().replace("lr: 0.001", "lr: -1.0"))
        assert wrong.read_text() != good.read_text()
        configs[bad] = wrong
        cause, fix = "optim.lr", f"on node {bad}: set optim.lr"
    else:
        (cfg.run_dir / "checkpoints" / "step-3").mkdir(parents=True)
        (cfg.run_dir / "checkpoints" / "step-3" / "model.safetensors").write_bytes(b"weights")
        cause, fix = "already holds a run", f"on node {bad}: pass --resume"
    t = time.monotonic()
    procs += start_nodes(good, tmp_path, configs=configs)
    codes = [p.wait(150) for p in procs]
    took = time.monotonic() - t
    other = 1 - bad
    assert codes[bad] == 2 and codes[other] == 1, outputs(tmp_path)
    assert took < 90, f"{took:.1f} s: the other node waited for the timeout"  # it is 180 s
    fatal = [e for e in read_events(cfg.run_dir / f"node-{other}" / "events.jsonl")
             if isinstance(e, Error) and e.fatal]
    assert fatal and f"node {bad}" in fatal[0].message and "before joining" in fatal[0].message
    assert cause in fatal[0].message, fatal[0].message  # the bad node's own error
    assert fatal[0].hint.startswith(fix), fatal[0].hint
    assert f"node {bad}" in outputs(tmp_path)[other]


@pytest.mark.slow  # the fast path: test_a_node_refused_before_joining_fails_the_other_at_once
def test_a_node_that_never_joins_is_named_after_the_timeout(tmp_path, assets, procs):
    cfg = node_config(tmp_path, assets, nodes__timeout_s=2.0)
    path = write_config(tmp_path / "config.yaml", cfg)
    procs += start_nodes(path, tmp_path)
    procs[1].kill()  # never reaches the store
    assert procs[0].wait(20) == 1, outputs(tmp_path)
    fatal = [e for e in read_events(cfg.run_dir / "node-0" / "events.jsonl")
             if isinstance(e, Error) and e.fatal]
    assert "node 1 did not join within 2 s" in fatal[0].message, fatal[0].message
    assert "console of node 1" in fatal[0].hint


@pytest.mark.slow  # fast path: test_a_node_refused_before_joining_fails_the_other_at_once[0-folder]
def test_an_abort_while_joining_ends_that_node_and_tells_the_others(tmp_path, assets, procs):
    """Node 1 is stopped while it waits for node 2 (never started): it ends at once as aborted,
    and node 0, waiting too, is told who stopped and ends as aborted too, instead of waiting out
    nodes.timeout_s."""
    cfg = node_config(tmp_path, assets, nodes__timeout_s=60.0)
    port = free_port()
    procs += start_nodes(write_config(tmp_path / "config.yaml", cfg), tmp_path, world=3, port=port)
    procs[2].kill()  # never reaches the store
    # Node 1 is joining once it has posted itself in node 0's store (node_join.py: join/K).
    deadline = time.monotonic() + 60
    store = None
    while True:
        assert time.monotonic() < deadline, outputs(tmp_path, 2)
        assert procs[0].poll() is None and procs[1].poll() is None, outputs(tmp_path, 2)
        try:
            store = store or dist.TCPStore("127.0.0.1", port, is_master=False,
                                           timeout=datetime.timedelta(seconds=5))
            if store.check(["dflash/0/join/1"]):
                break
        except (RuntimeError, OSError):  # node 0 has not opened its store yet
            pass
        time.sleep(0.2)
    t = time.monotonic()
    procs[1].send_signal(signal.SIGTERM)  # headless: abort, as the dashboard's a does
    assert procs[1].wait(EXIT_WITHIN_S) == 130, outputs(tmp_path, 2)
    assert procs[0].wait(EXIT_WITHIN_S) == 130, outputs(tmp_path, 2)  # an abort on any node
    assert time.monotonic() - t < EXIT_WITHIN_S  # not the 60 s join timeout
    for k in (1, 0):
        ev = read_events(cfg.run_dir / f"node-{k}" / "events.jsonl")
        assert [e.status for e in ev if isinstance(e, RunEnded)] == ["aborted"]
    said = [e.message for e in ev if isinstance(e, Log)]  # node 0's: told why, by whom
    assert any("node 1" in m and "aborted before joining: stopped while joining" in m
               for m in said), said
    assert list_checkpoints(cfg.run_dir) == []  # nothing trained, nothing written


# --------------------------------------------------------------------------------------------
# Small parts
# --------------------------------------------------------------------------------------------

def test_resume_needs_the_same_number_of_nodes():
    two = SimpleNamespace(trainer_state={"nodes": 2}, path=Path("runs/r/checkpoints/step-5"))
    check_resume_nodes(two, 2)
    with pytest.raises(ConfigError, match="2 node.*this run has 1") as err:
        check_resume_nodes(two, 1)
    assert "--nnodes 2" in err.value.hint
    one = SimpleNamespace(trainer_state={}, path=Path("runs/r/checkpoints/step-5"))
    check_resume_nodes(one, 1)  # written on one node, before nodes existed
    with pytest.raises(ConfigError):
        check_resume_nodes(one, 3)


class FakeGroup:
    """Answers an exchange with this node's summary and copies of it from other nodes, each
    changed by ``others``."""

    rank, world, host, timeout_s = 0, 2, "h", 15.0

    def __init__(self, others: dict):
        self.others = others

    def exchange(self, payload, **kw):
        return [payload, {**payload, "node": 1, **self.others}]


def fake_run(step: int):
    p = torch.nn.Parameter(torch.ones(3))
    rep = SimpleNamespace(params=lambda: [p], micro=SimpleNamespace(samples=1, tokens=4,
                                                                     weight_sum=1.0))
    return SimpleNamespace(
        replicas=[rep], heartbeats=SimpleNamespace(beat=lambda *a: None), step=step,
        total_steps=10, resume=None, abort_requested=False, hs_queue=None, prefetchers=[],
        position=None, target_devices=[], drafter_devices=[], stop=SimpleNamespace(set=lambda: 0))


def link_for(others: dict, run, **kw) -> NodeLink:
    callbacks = {"fail": lambda ev: None, "restart": lambda: None, "restarting": lambda: False,
                 **kw}
    return NodeLink.from_config(NodesConfig(checksum_every=2), 60.0, run, FakeGroup(others),
                                lambda ev: None, **callbacks)


def test_the_link_is_made_from_the_config_it_serves():
    link = link_for({}, fake_run(step=0))
    assert (link.checksum_every, link.timeout_s, link.stall_s) == (2, NodesConfig.timeout_s, 60.0)


def test_different_weights_on_another_node_fail_naming_the_step():
    link = link_for({"checksum": 1.5}, fake_run(step=4))
    with pytest.raises(NodeMismatch, match="differ across nodes at step 4"):
        link.boundary()
    assert link.over  # no farewell after it: every node saw the same mismatch
    same = link_for({}, fake_run(step=4))
    assert same.boundary().stop is False
    assert weights_checksum([torch.ones(3), torch.zeros(2)]) != weights_checksum(
        [torch.zeros(2), torch.ones(3)])


def test_nodes_that_plan_other_steps_are_refused_at_the_first_step():
    with pytest.raises(NodeMismatch, match="node 1 plans 12 optimizer steps"):
        link_for({"total_steps": 12}, fake_run(step=0)).boundary()


def test_a_node_that_failed_fails_the_others_naming_it():
    failures = []
    run = fake_run(step=3)
    link = link_for({"ending": "failed", "error": "drafter-0: boom"}, run, fail=failures.append)
    assert link.boundary().stop and link.over
    assert run.peer_failed  # node 0 still writes its checkpoint
    assert failures[0].source == "node-1" and "node 1 (h) failed: drafter-0: boom" in \
        failures[0].message


def test_a_restart_on_another_node_restarts_this_one():
    restarts = []
    run = fake_run(step=3)
    link = link_for({"abort": True, "restart": True}, run, restart=lambda: restarts.append(1))
    assert link.boundary().stop
    assert run.abort_requested and restarts == [1]
