"""The dashboard's view model: scripted events in, view state out (no Textual involved)."""

from __future__ import annotations

import pytest
import tui_scenarios as sc
from dflash_core.observe import events as ev
from dflash_tui.sources import postmortem
from dflash_tui.state.dashboard import DashboardState
from tui_scenarios import fold

GIB = sc.GIB


def test_target_goes_loading_warmup_running():
    s = fold(sc.loading())
    t0, t1 = s.targets["target-0"], s.targets["target-1"]
    assert t0.status == "warmup" and t0.memory_after == int(54.2 * GIB)
    assert t1.status == "loading" and t1.shards_total == 12 and 0 < t1.bytes_loaded < t1.bytes_total
    assert s.state == "loading"
    s.apply(ev.TargetMetrics(worker="target-1", device="cuda:1", batches=3, tokens_per_s=30_000,
                             blocked_frac=0.1, ts=sc.T0 + 200))
    assert t1.status == "running" and t1.tokens_per_s == 30_000


def test_failed_target_shows_why():
    s = fold(sc.failed())
    t3 = s.targets["target-3"]
    assert t3.status == "failed"
    assert t3.error == "[oom] CUDA out of memory. Tried to allocate 29.61 GiB"
    # the others said nothing more: the run is over, so they are shown stopped, with their last rate
    assert s.targets["target-2"].status == "stopped" and s.targets["target-2"].tokens_per_s > 0


def test_queue_rows_ordered_with_history():
    s = fold(sc.training(steps=12))
    assert list(s.queues) == [f"prefetch-{i}" for i in range(7)] + ["hs"]
    hs = s.queues["hs"]
    assert (hs.depth, hs.capacity) == (3, 8)
    assert list(hs.history) == [min(8, i // 4) for i in range(1, 13)]


def test_training_loss_history_eval_and_clock():
    s = fold(sc.training(steps=60))
    assert len(s.loss_history) == 60 and s.step.step == 60
    assert s.loss_history[0] > s.loss_history[-1]
    assert s.eval.tau == 2.87
    assert s.elapsed == 240.0  # event time: RunStarted at T0, last event at T0+240
    assert s.steps_per_s == 0.5
    assert s.eta == (6000 - 60) / 0.5
    assert s.wandb == "runs/qwen36-dflash/wandb/offline-run-1"


def test_errors_listed_counted_and_logged():
    s = fold(sc.failed())
    assert s.state == "failed" and not s.live
    assert s.error_count == 1 and s.errors[0].event.error_kind == "oom"
    assert s.eta is None
    assert s.elapsed == 242.0  # stops at the RunEnded
    texts = [x.text for x in s.log]
    assert "[oom] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 29.61 GiB" in texts
    assert any(t.startswith("run ended: failed at step 60") for t in texts)
    assert any(t.startswith("step 60 saved to runs/qwen36-dflash/ckpt/step-60") for t in texts)


def test_changed_panels_are_reported():
    s = DashboardState()
    assert s.apply(ev.QueueDepth(name="hs", depth=1, capacity=8, ts=sc.T0)) == {"queues", "header"}
    assert "errors" in s.apply(sc.oom_error(1))
    assert s.apply(ev.Log(level="info", source="x", message="m", ts=sc.T0)) == {"log", "header"}


def test_malformed_event_becomes_an_error_not_a_crash():
    s = DashboardState()
    s.apply(ev.MemoryPlan(rows=[{"device": "cuda:0", "total": "lots"}], ts=sc.T0))
    assert s.error_count == 1 and s.errors[0].event.source == "dashboard"


def test_restart_resets_the_run_but_keeps_errors():
    s = fold(sc.failed())
    s.apply_all(sc.start(t=500))
    assert s.step is None and not s.loss_history and not s.targets and s.state == "loading"
    assert s.error_count == 1 and s.elapsed == 2.0


def write_jsonl(path, events):
    path.write_text("".join(e.to_json() + "\n" for e in events))


def test_postmortem_of_a_run_without_run_ended(tmp_path):
    events = sc.failed()[:-1]  # the process died before writing RunEnded
    write_jsonl(tmp_path / "events.jsonl", sc.aborted() + events)  # an earlier run ended fine
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"event": "StepMetr')  # torn last line
    pm = postmortem.load(tmp_path)
    assert pm is not None
    assert (pm.last_state, pm.last_step.step, pm.errors) == ("failed", 60, 1)
    assert pm.last_error.error_kind == "oom"
    lines = pm.lines()
    assert "ended without RunEnded" in lines[0]
    assert "last state failed" in lines[1]
    assert lines[2].startswith("last step 60/6000 (epoch 0), loss ")
    assert lines[3].startswith("1 error(s); last: [oom] target-3:")
    assert lines[4] == "hint: lower data.token_budget in config.yaml (65536 -> 32768)"
    s = DashboardState()
    s.add_postmortem(pm)
    assert [x.source for x in s.log] == ["post-mortem"] * 5
    assert s.errors[0].previous and s.error_count == 0  # shown, not counted against this run


def test_no_postmortem_when_the_run_ended(tmp_path):
    write_jsonl(tmp_path / "events.jsonl", sc.failed())
    assert postmortem.load(tmp_path) is None
    assert postmortem.load(tmp_path / "missing") is None


def test_live_clock_ticks_between_events_but_a_replay_does_not():
    s = fold(sc.training(steps=5))  # last event at T0+130, state training
    assert s.elapsed == 130.0
    assert s.tick(sc.T0 + 135.2) and s.elapsed == pytest.approx(135.2)
    assert not s.tick(sc.T0 + 135.3)  # same second: no redraw needed
    assert not s.tick(sc.T0 + 10_000)  # stream long silent: a replay, or a hung engine
    assert s.elapsed == pytest.approx(135.3)
    s = fold(sc.aborted())
    assert not s.tick(s.now + 1)  # not live: the clock stopped with the run


def test_tight_memory_on_a_rehearsed_card_warns_once_until_it_recovers():
    s = fold(sc.start())

    def sample(used_gib, retries=0, ts=0.0):
        s.apply(ev.GpuSample(index=7, name="x", mem_used=int(used_gib * GIB), mem_total=141 * GIB,
                             limit=95 * GIB, alloc_retries=retries, role="drafter",
                             ts=sc.T0 + ts))

    def warnings():
        return [line.text for line in s.log if line.level == "warning" and "tight" in line.text]

    sample(80)
    assert warnings() == []
    sample(93, ts=1)  # 2 GiB of 95 left: under 3%
    sample(93.5, ts=2)
    assert len(warnings()) == 1 and "GiB left of 95.0" in warnings()[0]
    sample(80, ts=3)  # recovered
    sample(80, retries=2, ts=4)  # the allocator started retrying
    assert len(warnings()) == 2 and "free its cache 2 times" in warnings()[1]
    row = s.gpu_rows()[7]
    assert (row.limit, row.alloc_retries) == (95 * GIB, 2)


def test_a_stall_is_a_warning_in_the_log_and_the_header_until_progress():
    s = fold(sc.start())
    s.apply(ev.Stall(worker="drafter-0", phase="training step", seconds=75.0,
                     where="compiling: torch/_inductor/compile_fx.py:900 compile_fx",
                     stack="...", ts=sc.T0 + 100))
    assert "drafter-0" in s.stalls
    (line,) = [x for x in s.log if x.source == "drafter-0"]
    assert line.level == "warning" and "no progress for 75 s in training step" in line.text
    assert "compiling: torch/_inductor" in line.text
    assert not s.errors  # a warning, never an error
    s.apply(ev.Stall(worker="drafter-0", phase="training step", seconds=0.0, where="", stack="",
                     cleared=True, ts=sc.T0 + 130))
    assert s.stalls == {}
    assert "progress again" in s.log[-1].text


# --------------------------------------------------------------------------------------------
# The screen says exactly what is true: failed starts, ends, resumes, limits, checkpoints
# --------------------------------------------------------------------------------------------

def header_lines(s: DashboardState, width: int, lines: int = 2) -> list[str]:
    from dflash_tui.widgets.header import HeaderBar

    return HeaderBar.draw(s, width, lines).plain.split("\n")


@pytest.mark.parametrize("width", [80, 120, 160])
def test_a_failed_start_keeps_the_header_on_one_line_and_points_to_the_errors(width):
    s = fold(sc.failed_preflight())
    first, second = header_lines(s, width)
    assert len(first) <= width and "FAILED" in first and first.rstrip().endswith("1")
    assert "(e: errors)" in first and "layout.device: cuda" in first
    assert "ConfigError" not in first  # the kind is in the errors pane; the cells go to the why
    if width >= 120:
        assert "cuda requested but no CUDA device is visible (e: errors)" in first
    assert s.ended_before("loading") == "the run failed before loading"
    assert s.ended_before("preflight") == ""
    assert s.failure is not None and s.failure.error_kind == "config"


def test_a_long_failure_reason_is_cut_in_the_header_never_wrapped():
    s = fold(sc.failed())
    for width in (60, 80, 100, 200):
        first = header_lines(s, width)[0]
        assert len(first) <= width and "step 60/6000" in first and "err" in first
        # no room for the reason: where to read it, at least
        assert ("target-3" in first) if width >= 80 else ("e: errors" in first)


def test_every_worker_says_how_it_ended_in_one_log_line():
    s = fold(sc.aborted())
    assert {w.status for w in s.workers.values()} == {ev.WORKER_STOPPED}
    assert {t.status for t in s.targets.values()} == {ev.WORKER_STOPPED}
    texts = [x.text for x in s.log if x.source == "workers"]
    assert texts == ["stopped: " + ", ".join([f"target-{i}" for i in range(7)] + ["drafter-0"])]
    # A worker that said nothing more (an older engine's events) is shown stopped too, not running
    s = fold(sc.start(targets=["cpu:0"], drafters=["cpu:0"]) + [
        ev.WorkerStatus(worker="target-0", role="target", device="cpu", status="running",
                        ts=sc.T0 + 3),
        ev.StateChanged(state="aborted", previous="training", ts=sc.T0 + 4)])
    assert s.workers["target-0"].status == ev.WORKER_STOPPED


def test_a_resume_never_shows_step_0_and_the_end_says_its_step():
    s = fold(sc.training(steps=5))
    assert s.current_step == 5
    events = sc.resumed_at_the_end()
    s.apply_all(events[:2])  # the restart's RunStarted: which step is not known yet
    assert s.current_step is None and "step -/" not in header_lines(s, 120)[0]
    assert "step -" in header_lines(s, 120)[0]
    s.apply_all(events[2:6])  # its TrainingPlan: the checkpoint's step
    assert s.current_step == 512 and "step 512/512" in header_lines(s, 120)[0]
    s.apply_all(events[6:])
    assert s.state == "finished" and "step 512/512" in header_lines(s, 120)[0]
    assert s.end_step == 512


def test_the_plan_says_which_limit_ends_the_run():
    s = fold(sc.resumed_at_the_end())
    assert any("512 steps = 8 epochs of the data (optim.epochs); --max-steps 100000 is past it"
               in x.text for x in s.log)
    assert "ends 8 epochs" in header_lines(s, 80)[1]
    assert "ends 8 epochs (--max-steps 100000 is past them)" in header_lines(s, 160)[1]
    s.apply(sc.plan(total=100, max_steps=100, max_steps_from="run.max_steps", ts=sc.T0 + 9))
    assert "ends run.max_steps 100" in header_lines(s, 120)[1]


def test_a_checkpoint_being_written_shows_until_it_is_written():
    events = sc.checkpoint_writing()
    s = fold(events)
    assert "checkpoint step 60: 12.3G/40.1G at 2.1G/s" in header_lines(s, 80)[1]
    s.apply(ev.Checkpoint(step=60, path="runs/x/step-60", seconds=19.0, ts=events[-1].ts + 13))
    assert "checkpoint step" not in "\n".join(header_lines(s, 160, 3))
    s.apply(ev.CheckpointProgress(step=80, bytes_written=GIB, bytes_total=40 * GIB, seconds=1,
                                  ts=events[-1].ts + 20))
    s.apply(ev.Error(error_kind="io", source="checkpoint", message="disk full", fatal=False,
                     ts=events[-1].ts + 21))
    assert s.checkpoint_writing is None  # a failed write ends its progress line too


def test_the_second_header_line_gives_way_by_priority():
    s = fold(sc.checkpoint_writing())
    second = header_lines(s, 80)[1]
    # what is going on now and the run's limit first; the wandb folder gives way
    assert second.startswith("checkpoint step 60") and "ends 3 epochs" in second
    assert "wandb" not in second and len(second) <= 80
    tall = header_lines(s, 120, 3)
    assert len(tall) == 3 and "wandb runs/qwen36-dflash" in "\n".join(tall)
