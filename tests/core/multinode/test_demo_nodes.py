"""The demo on several nodes: node 0 picks the fresh run folder (runs/demo-2 beside an earlier
demo) and the others learn it through the store, so every node writes the same folder name even
when each looks at its own disk."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from dflash_core.multinode.node_failure import NodeFailure
from dflash_core.multinode.node_place import NodeInfo
from dflash_core.multinode.nodes import NodeGroup
from dflash_core.observe.events import RunStarted, StepMetrics
from dflash_core.observe.event_log import read_events

from .test_nodes import free_port, node_env, procs  # noqa: F401 (a fixture)

# The demo's assets, built by the session's fixture (a fresh cache builds them beside other tests).
pytestmark = pytest.mark.usefixtures("demo_target")

EXIT_WITHIN_S = 30.0


@pytest.fixture
def store_env(monkeypatch):
    """The variables torchrun sets, for two NodeGroups of this process (node 0 serves)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


def groups() -> tuple[NodeGroup, NodeGroup]:
    return NodeGroup(NodeInfo(rank=0, world=2)), NodeGroup(NodeInfo(rank=1, world=2))


def test_the_other_nodes_take_node_0s_pick(store_env):
    node0, node1 = groups()
    got, picked = {}, []
    waiter = threading.Thread(target=lambda: got.update(name=node1.agree(
        "run.name", lambda: picked.append(1) or "mine", 10.0, waiting=lambda: got.update(
            waited=True))))
    node0._open_store(10.0)  # node 0 serves the store; node 1 may reach it before the pick
    waiter.start()
    time.sleep(1.3)  # node 1 waits, and says so once
    assert node0.agree("run.name", lambda: "demo-2", 10.0) == "demo-2"
    waiter.join(10)
    assert got == {"name": "demo-2", "waited": True} and not picked  # node 1 never picks
    # the store opened for the pick is the one the join uses: node 0 serves it once
    assert node0._open_store(1.0) is node0._opened


def test_a_node_0_that_failed_before_naming_it_is_named(store_env):
    node0, node1 = groups()
    node0._open_store(10.0)
    node0.tell_join_failure("failed", "config error: run.output_dir ...", "set it", wait_s=0.5)
    with pytest.raises(NodeFailure) as exc:
        node1.agree("run.name", lambda: "x", 10.0)
    assert "node 0" in str(exc.value) and "failed before it named the run.name" in str(exc.value)
    assert exc.value.nodes == [0] and exc.value.hint.startswith("on node 0: set it")


def test_waiting_for_node_0_ends_at_the_timeout_or_a_stop(store_env):
    node0, node1 = groups()
    node0._open_store(10.0)
    t = time.monotonic()
    with pytest.raises(NodeFailure) as exc:
        node1.agree("run.name", lambda: "x", 0.5)
    assert "node 0 did not name the run.name within" in str(exc.value)
    assert time.monotonic() - t < 5
    with pytest.raises(NodeFailure) as exc:
        node1.agree("run.name", lambda: "x", 30.0, stopped=lambda: True)
    assert exc.value.ending == "aborted"


@pytest.mark.timeout(600)  # a fresh cache builds the demo target first (~2 minutes on 2 cores)
def test_the_demo_trains_on_two_nodes_in_the_folder_node_0_picked(tmp_path, procs):
    """Two node processes, each with its own disk (working folder): node 0's holds an earlier
    demo, so it picks runs/demo-2; node 1's does not (alone it would take runs/demo), yet it
    writes runs/demo-2/node-1. An abort on node 0 then ends both."""
    disks = [tmp_path / "node0", tmp_path / "node1"]
    for disk in disks:
        disk.mkdir()
    earlier = disks[0] / "runs" / "demo" / "checkpoints" / "step-9"  # a run with something to lose
    earlier.mkdir(parents=True)
    (earlier / "config.json").write_text("{}\n")
    port = free_port()
    for rank, disk in enumerate(disks):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "dflash_tui.cli", "demo", "--headless", "--device", "cpu"],
            env=node_env(rank, 2, port), cwd=disk, stdout=open(disk / "out.txt", "w"),
            stderr=subprocess.STDOUT))
    events = [disk / "runs" / "demo-2" / f"node-{k}" / "events.jsonl"
              for k, disk in enumerate(disks)]
    deadline = time.monotonic() + 480
    while not all(p.exists() and any(isinstance(e, StepMetrics) for e in read_events(p))
                  for p in events):
        outs = [(d / "out.txt").read_text()[-2000:] for d in disks]
        assert all(p.poll() is None for p in procs), outs
        assert time.monotonic() < deadline, outs
        time.sleep(0.5)
    procs[0].send_signal(signal.SIGTERM)
    codes = [p.wait(EXIT_WITHIN_S) for p in procs]
    assert codes == [130, 130], [(d / "out.txt").read_text()[-2000:] for d in disks]
    started = [[e for e in read_events(p) if isinstance(e, RunStarted)] for p in events]
    assert [s[0].run_name for s in started] == ["demo-2", "demo-2"]
    assert not (disks[1] / "runs" / "demo").exists()  # node 1 did not pick on its own
    assert os.listdir(earlier.parents[1]) == ["checkpoints"]  # the earlier run left as it was
