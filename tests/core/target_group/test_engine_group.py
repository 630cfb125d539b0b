"""The engine with a target group: it trains as with a one-GPU target of the same weights and
data; a killed rank fails the run naming it, leaves the last checkpoint and no process behind,
and a resume trains on; what cannot be split is refused in one line."""

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from dflash_core.observe.events import Error, StepMetrics, WorkerStatus
from dflash_core.pipeline.engine import Engine

from ..engine_fixtures import Recorder, assets, make_config, write_config  # noqa: F401
from ..models.target.target_classes import build
from ..pipeline.test_headless import ROOT, Headless

GROUP = dict(layout__targets=[0, 1], target__gpus_per_copy=2)


def losses(cfg) -> list[float]:
    engine = Engine(cfg)
    rec = Recorder(engine.bus)
    engine.start()
    ended = rec.wait_ended(120)
    engine.shutdown()
    assert ended.status == "finished", [e.message for e in rec.of(Error)]
    return [m.loss for m in rec.of(StepMetrics)], rec


@pytest.fixture(scope="module")
def one_gpu_losses(assets, tmp_path_factory):
    target, data = assets
    return losses(make_config(tmp_path_factory.mktemp("one"), target, data,
                              data__eval_prompts=0))[0]


@pytest.mark.parametrize("mode", ["sharded", pytest.param("shared", marks=pytest.mark.slow)])
def test_a_group_trains_as_one_gpu_target_of_the_same_weights(assets, tmp_path, one_gpu_losses,
                                                                mode):
    target, data = assets
    cfg = make_config(tmp_path, target, data, data__eval_prompts=0, target__parallel=mode,
                      **GROUP)
    got, rec = losses(cfg)
    # fp32 on the CPU: the group's forward differs from one process's by summation order only
    # (features within 1e-7 here), far below what moves a loss in its 5th digit
    assert got == pytest.approx(one_gpu_losses, rel=1e-5)
    assert len(got) == 6
    rows = {e.worker: e.device for e in rec.of(WorkerStatus) if e.role == "target"}
    if mode == "sharded":  # a row per rank, each its own batch stream
        assert rows == {"target-0": "cpu:0.0 copy 0 rank 0/2", "target-1": "cpu:0.1 copy 0 rank 1/2"}
    else:  # one stream; rank 1 a row of its own under it
        assert rows == {"target-0": "cpu:0.0 copy 0 rank 0/2",
                        "target-0.r1": "cpu:0.1 copy 0 rank 1/2"}
    assert not live_ranks()


def live_ranks() -> list:
    """This process's children that are ranks and still run (multiprocessing's resource
    tracker, started once per process, may stay; another test's exited child may be a zombie)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # gone, or a zombie, between the listing and the look
            pass
    return found


def rank_pids(run: Headless) -> list[int]:
    line = run.wait_line("target group 0: 2 ranks")
    return [int(p) for p in re.search(r"pids \[([\d, ]+)\]", line).group(1).split(", ")]


@pytest.mark.slow  # fast path: test_eval_group.py's killed rank, test_group_faults.py's naming
def test_a_killed_rank_fails_the_run_naming_it_and_a_resume_trains_on(assets, tmp_path):
    target, data = assets
    cfg = make_config(tmp_path, target, data, data__eval_prompts=0, run__max_steps=0,
                      optim__epochs=200, checkpoint__every=2, checkpoint__on_abort=False,
                      **GROUP)
    path = write_config(tmp_path / "config.yaml", cfg)
    run = Headless(path)
    pids = rank_pids(run)
    run.wait_line("checkpoint step 4")
    os.kill(pids[1], signal.SIGKILL)
    rc, out, err = run.finish(60)
    assert rc == 1, out + err
    assert re.search(r"target group 0 rank 1 \(cpu:0\.1, pid \d+\) killed by SIGKILL", out), out
    # said once (both streams of the copy see it), as memory (the kernel's OOM killer), not a
    # bug: no traceback on the console, the headless way to go on in the hint
    said = [x for x in out.splitlines() if "killed by SIGKILL" in x and "ERROR" in x]
    assert len(said) == 1 and "[oom]" in said[0], out
    assert "Traceback" not in out and "out-of-memory killer" in out and "--resume" in out
    for pid in pids:  # no rank outlives the run
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    saved = sorted(int(p.name.split("-")[1]) for p in (cfg.run_dir / "checkpoints").glob("step-*"))
    assert saved and saved[-1] >= 4
    # a resume trains on from the last checkpoint
    cfg2 = make_config(tmp_path, target, data, data__eval_prompts=0, run__max_steps=saved[-1] + 2,
                       checkpoint__every=2, **GROUP)
    rc, out, err = Headless(write_config(tmp_path / "config2.yaml", cfg2), "--resume").finish(90)
    assert rc == 0, out + err
    assert f"step {saved[-1] + 1} " in out and "-> finished" in out


@pytest.mark.slow
def test_the_engine_killed_leaves_no_rank_behind(assets, tmp_path):
    target, data = assets
    cfg = make_config(tmp_path, target, data, data__eval_prompts=0, run__max_steps=0,
                      optim__epochs=200, **GROUP)
    run = Headless(write_config(tmp_path / "config.yaml", cfg))
    pids = rank_pids(run)
    run.wait_line("state warmup -> training")
    run.proc.kill()
    run.finish(30)
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(psutil.pid_exists(p) for p in pids)


def test_what_cannot_be_split_is_refused_in_one_line(assets, tmp_path):
    _, data = assets
    moe = tmp_path / "moe"
    build("qwen3_moe").save_pretrained(moe)
    cfg = make_config(tmp_path, moe, data, target__parallel="shared", target__layer_ids=[1, 2],
                      target__expert_parallel=False, **GROUP)
    rc, out, err = Headless(write_config(tmp_path / "config.yaml", cfg)).finish(60)
    assert rc == 2, out + err
    assert "tensor parallel alone leaves all 8 experts" in out and "Traceback" not in out + err
    assert "target.expert_parallel" in out
    # a size that does not cut layout.targets into copies: refused as the config is read
    res = subprocess.run([sys.executable, "-m", "dflash_tui.cli", "--headless", "--config",
                          str(tmp_path / "config.yaml"), "--set", "target.gpus_per_copy=3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stdout + res.stderr
    assert "larger than the 2 GPU(s) layout.targets lists" in res.stdout + res.stderr


@pytest.mark.slow
def test_a_group_run_resumed_without_the_group_trains_on_as_one_run(assets, tmp_path,
                                                                    one_gpu_losses):
    """The batch plan and the data position do not depend on how the target is split: a run of
    a sharded group, aborted after step 3 and resumed on a one-GPU target, trains the steps an
    uninterrupted one-GPU run trains."""
    target, data = assets
    cfg = make_config(tmp_path, target, data, data__eval_prompts=0, **GROUP)
    first = Engine(cfg)
    rec = Recorder(first.bus)
    first.bus.tap(lambda ev: first.abort() if isinstance(ev, StepMetrics) and ev.step == 3
                  else None)
    first.start()
    assert rec.wait_ended(120).status == "aborted"
    first.shutdown()
    again = Engine(make_config(tmp_path, target, data, data__eval_prompts=0), resume=True)
    rec2 = Recorder(again.bus)
    again.start()
    assert rec2.wait_ended(120).status == "finished"
    again.shutdown()
    resumed = rec2.of(StepMetrics)
    assert [m.step for m in resumed] == [4, 5, 6]
    assert [m.loss for m in resumed] == pytest.approx(one_gpu_losses[3:], rel=1e-5)
