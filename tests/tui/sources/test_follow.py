"""Attaching to a run owned by another process: its events.jsonl is followed as it grows, abort and
restart travel as command files, and quitting the dashboard leaves the run alone."""

from __future__ import annotations

import threading
import time

import pytest
import tui_scenarios as sc

from dflash_core.observe import events as ev
from dflash_core.observe.event_log import read_events
from dflash_core.pipeline.inbox import CommandInbox, command_dir
from dflash_tui.app import DFlashApp
from dflash_tui.sources.follow import FollowController
from dflash_tui.sources.replay import ReplayController
from tests.core.engine_fixtures import assets  # noqa: F401 - a fixture


class Collect:
    def __init__(self, bus):
        self.events: list[ev.Event] = []
        self.cond = threading.Condition()
        bus.tap(self._add)

    def _add(self, e):
        with self.cond:
            self.events.append(e)
            self.cond.notify_all()

    def wait_for(self, pred, timeout=5.0):
        with self.cond:
            assert self.cond.wait_for(lambda: any(pred(e) for e in self.events), timeout), \
                [type(e).__name__ for e in self.events]

    def of(self, cls):
        return [e for e in self.events if isinstance(e, cls)]


def write(path, events, mode="a"):
    with open(path, mode, encoding="utf-8") as f:
        for e in events:
            f.write(e.to_json() + "\n")


def test_follows_the_last_run_and_waits_for_whole_lines(tmp_path):
    first = sc.failed()  # an earlier run in the same file, ended
    second = sc.start()
    write(tmp_path / "events.jsonl", first + second, mode="w")
    ctl = FollowController(tmp_path, poll_s=0.02)
    got = Collect(ctl.bus)
    ctl.start()
    try:
        got.wait_for(lambda e: isinstance(e, ev.Log) and e.source == "attach")
        assert len(got.of(ev.RunStarted)) == 1  # only the last run
        assert not got.of(ev.RunEnded)
        # A line arriving in two writes is read once it is whole.
        line = ev.StepMetrics(step=7, epoch=0, loss=1.25, lr=1e-4, grad_norm=0.5,
                              tokens_per_s=1.0, samples_per_s=1.0, tau_tf=2.0,
                              drafter_wait_frac=0.0, target_blocked_frac=0.0, padding_frac=0.0,
                              samples=4, total_steps=100, ts=sc.T0 + 50).to_json() + "\n"
        with open(tmp_path / "events.jsonl", "a", encoding="utf-8") as f:
            f.write(line[:40])
            f.flush()
            time.sleep(0.2)
            assert not got.of(ev.StepMetrics)
            f.write(line[40:])
        got.wait_for(lambda e: isinstance(e, ev.StepMetrics))
        assert [s.step for s in got.of(ev.StepMetrics)] == [7]
        write(tmp_path / "events.jsonl", [ev.RunEnded(status="aborted", step=7, seconds=9.0)])
        got.wait_for(lambda e: isinstance(e, ev.RunEnded))
        assert ctl.state == "aborted"
    finally:
        ctl.shutdown(timeout=5)


def test_commands_reach_the_owner_through_its_inbox(tmp_path):
    write(tmp_path / "events.jsonl", sc.training(), mode="w")
    owner = ReplayController([])  # stands in for the engine in the other process
    inbox = CommandInbox(owner, tmp_path, owner.bus.publish, poll_s=0.05)
    inbox.start()
    ctl = FollowController(tmp_path, poll_s=0.02)
    got = Collect(ctl.bus)
    try:
        ctl.start()
        ctl.abort()
        deadline = time.monotonic() + 3
        while owner.calls != ["abort"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert owner.calls == ["abort"]
        assert list(command_dir(tmp_path).iterdir()) == []
        time.sleep(ctl.pickup_s + 0.2)
        assert not got.of(ev.Error)  # picked up: no complaint
    finally:
        inbox.close()
        ctl.shutdown(timeout=5)


def test_a_command_nobody_reads_is_reported_and_withdrawn(tmp_path):
    write(tmp_path / "events.jsonl", sc.training(), mode="w")
    ctl = FollowController(tmp_path, poll_s=0.02, pickup_s=0.3)
    got = Collect(ctl.bus)
    try:
        ctl.start()
        ctl.restart()
        got.wait_for(lambda e: isinstance(e, ev.Error))
        (err,) = got.of(ev.Error)
        assert "restart was not picked up" in err.message and "kill -INT" in err.hint
        assert list(command_dir(tmp_path).iterdir()) == []  # a later owner will not act on it
    finally:
        ctl.shutdown(timeout=5)


@pytest.mark.anyio
async def test_quitting_an_attached_dashboard_detaches_without_asking(tmp_path):
    write(tmp_path / "events.jsonl", sc.training(), mode="w")
    ctl = FollowController(tmp_path, poll_s=0.02)
    app = DFlashApp(ctl, run_dir=None, start=True)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause(1.2)
        assert "TRAINING" in app.query_one("#header").text
        assert "attached: q detaches" in app.query_one("#header").text
        await pilot.press("q")
        await pilot.pause(0.5)
        assert not app.is_running  # no "stop the run?" dialog: there is nothing to stop
    assert ctl.calls == ["start", "shutdown"]  # shutdown = stop following
    assert not command_dir(tmp_path).exists()  # nothing was sent to the run


def test_a_dashboard_attached_to_a_headless_run_restarts_and_aborts_it(tmp_path, assets):
    # The whole path as an operator uses it: `dflash-tui --headless` in one terminal, a follower
    # of its run folder in another; r restarts the run in place (the process goes on), a aborts.
    from tests.core.engine_fixtures import make_config, write_config
    from tests.core.pipeline.test_headless import Headless

    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=0, optim__epochs=200,
                      data__eval_prompts=0, checkpoint__every=0)
    run = Headless(write_config(tmp_path / "config.yaml", cfg))
    ctl = None
    try:
        run.wait_line("state warmup -> training")
        ctl = FollowController(cfg.run_dir, poll_s=0.05)
        got = Collect(ctl.bus)
        ctl.start()
        got.wait_for(lambda e: isinstance(e, ev.StepMetrics), 30)
        ctl.restart()
        run.wait_line("restart requested by an attached dashboard", 30)
        got.wait_for(lambda e: isinstance(e, ev.Log) and e.message.startswith("resuming from"), 60)
        n_steps = len(got.of(ev.StepMetrics))
        got.wait_for(lambda e: len(got.of(ev.StepMetrics)) > n_steps + 1, 60)
        assert run.proc.poll() is None  # the restart did not end the headless process
        ctl.abort()
        rc, out, err = run.finish(60)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
        if ctl is not None:
            ctl.shutdown(timeout=5)
    assert rc == 130, out + err
    events = read_events(cfg.run_dir / "events.jsonl")
    assert len([e for e in events if isinstance(e, ev.RunStarted)]) == 2
    assert [e.status for e in events if isinstance(e, ev.RunEnded)] == ["aborted", "aborted"]
    assert not got.of(ev.Error)


def test_attach_to_a_folder_without_a_run_says_what_to_pass(tmp_path, capsys):
    from dflash_tui.cli import main

    assert main(["--attach", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "nothing to attach to" in err and "events.jsonl does not exist" in err
    assert "hint: pass the run folder" in err


def test_attaching_late_to_a_long_run_reads_its_tail_and_every_state_event(tmp_path):
    # Days of GPU samples are skipped; what sets the screen (errors, states, checkpoints,
    # evaluations) is read from the whole run, the metrics from the last tail_bytes.
    early = [ev.Error(error_kind="data", source="loader-0", message="early error", fatal=False,
                      ts=sc.T0 + 1),
             ev.Checkpoint(step=10, path="runs/x/checkpoints/step-10", reason="periodic",
                           seconds=1.0, ts=sc.T0 + 2)]
    samples = [ev.GpuSample(index=i % 8, name="H200", mem_used=1, mem_total=2, util=50,
                            temperature=40, power=100.0, ts=sc.T0 + 3 + i * 0.01)
               for i in range(5000)]
    late = ev.EvalResult(step=20, tau=3.5, acceptance=[1, 2], prompts=2, ts=sc.T0 + 100)
    write(tmp_path / "events.jsonl", sc.failed() + sc.start() + early + samples + [late], mode="w")
    size = (tmp_path / "events.jsonl").stat().st_size
    ctl = FollowController(tmp_path, poll_s=0.02, tail_bytes=20_000)
    got = Collect(ctl.bus)
    try:
        ctl.start()
        got.wait_for(lambda e: isinstance(e, ev.Log) and e.message.startswith("attached to "
                                                                             + str(tmp_path)))
        assert len(got.of(ev.RunStarted)) == 1 and not got.of(ev.RunEnded)  # the last run only
        assert [e.message for e in got.of(ev.Error)] == ["early error"]
        assert [c.step for c in got.of(ev.Checkpoint)] == [10]
        assert [r.step for r in got.of(ev.EvalResult)] == [20]
        gpu = got.of(ev.GpuSample)
        assert 0 < len(gpu) < 5000 and gpu[-1].ts == samples[-1].ts  # the tail, in full
        assert sum(len(s.to_json()) + 1 for s in gpu) <= 20_000 + 200 < size  # + the cut line
        (note,) = [e for e in got.of(ev.Log) if "long run" in e.message]
        assert "metric lines before the last" in note.message
        # In the file's order (the screen folds events in order), a subsequence of the last run.
        index = {e.to_json(): i for i, e in enumerate(sc.start() + early + samples + [late])}
        seen = [index[e.to_json()] for e in got.events
                if not (isinstance(e, ev.Log) and e.source == "attach")]
        assert seen == sorted(seen)
    finally:
        ctl.shutdown(timeout=5)


@pytest.mark.parametrize("block", [7, 64, 1000, 1 << 20])
def test_state_lines_found_by_block_search_equal_a_line_by_line_scan(tmp_path, block):
    from dflash_tui.sources.follow import _state_lines

    events = sc.training()
    write(tmp_path / "events.jsonl", events, mode="w")
    data = (tmp_path / "events.jsonl").read_bytes()
    want, pos = [], 0
    for line in data.splitlines(keepends=True):
        if ev.from_json(line).sets_state:
            want.append((pos, line.rstrip(b"\n")))
        pos += len(line)
    with open(tmp_path / "events.jsonl", "rb") as f:
        got, skipped = _state_lines(f, 0, len(data), block=block)
    assert got == want and skipped == len(events) - len(want) > 0


def test_a_run_folder_cleared_and_started_again_is_followed_anew(tmp_path):
    path = tmp_path / "events.jsonl"
    write(path, sc.training(steps=5), mode="w")
    ctl = FollowController(tmp_path, poll_s=0.02)
    got = Collect(ctl.bus)
    try:
        ctl.start()
        got.wait_for(lambda e: isinstance(e, ev.Log) and e.source == "attach")
        path.unlink()  # the operator cleared the folder and launched a new run of that name
        time.sleep(0.1)
        write(path, sc.start(), mode="w")
        got.wait_for(lambda e: isinstance(e, ev.Log) and "was replaced" in e.message)
        assert len(got.of(ev.RunStarted)) == 2
        write(path, [ev.RunEnded(status="failed", step=0, seconds=1.0)])
        got.wait_for(lambda e: isinstance(e, ev.RunEnded))
        assert ctl.state == "failed"
    finally:
        ctl.shutdown(timeout=5)
