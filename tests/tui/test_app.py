"""The dashboard driven by Textual's pilot: panels follow a replayed event stream, keys do what the
footer says, and errors show up fast without ever closing the app."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import tui_scenarios as sc
from textual.command import CommandList
from textual.widgets import DataTable

from dflash_core.observe import events as ev
from dflash_tui.app import DFlashApp
from dflash_tui.messages import EngineEvents
from dflash_tui.sources.replay import ReplayController
from dflash_tui.screens import KEYS, ConfirmScreen, HelpScreen
from dflash_tui.widgets.log import LogPanel

BIG = (160, 48)
pytestmark = pytest.mark.anyio


async def settle(pilot, seconds: float = 1.2) -> None:
    """Let the drain timer run and the panels redraw (sampled panels within 1 s)."""
    await pilot.pause(seconds)


async def wait_for(pilot, predicate, timeout: float = 2.0) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.02)
    return time.monotonic() - start


def panels(app):
    q = app.query_one
    return {name: q(f"#{name}") for name in ("header", "gpus", "targets", "queues", "training")}


async def test_panels_follow_the_event_stream():
    ctl = ReplayController(sc.loading())
    app = DFlashApp(ctl)
    async with app.run_test(size=BIG) as pilot:
        await settle(pilot)
        p = panels(app)
        assert "LOADING" in p["header"].text and "step 0/6000" in p["header"].text
        assert "wandb runs/qwen36-dflash/wandb/offline-run-1" in p["header"].text
        assert "target-0 cuda:0  warming up" in p["targets"].text
        assert "42.1/54.0G  61s  9/12 shards" in p["targets"].text  # target-1 loading
        assert " 0 target " in p["gpus"].text and "20.0/139.8G" in p["gpus"].text
        assert "plan 71.0G" in p["gpus"].text and "host RAM 180.0/2015.0G" in p["gpus"].text
        assert "no step yet" in p["training"].text

        # the rest of the run arrives from an engine thread: first training, then the failure
        def publish(events):
            threading.Thread(target=lambda: [ctl.publish(e) for e in events]).start()

        training, failed = sc.training(), sc.failed()
        publish(training[len(sc.loading()):])
        await settle(pilot)
        p = panels(app)
        assert "TRAINING" in p["header"].text and "ETA 3:18:00" in p["header"].text
        assert "target-0 cuda:0  31.0k tok/s  blocked 71%  starved 1%" in p["targets"].text
        assert "all targets 210.7k tok/s" in p["targets"].text
        publish(failed[len(training):])
        await settle(pilot)
        p = panels(app)
        assert "FAILED" in p["header"].text and "errors 1" in p["header"].text
        assert "target-0 cuda:0  stopped  last 31.0k tok/s  120 batches" in p["targets"].text
        assert "target-3 cuda:3  FAILED\n  [oom] CUDA out of memory" in p["targets"].text
        assert "74.0/139.8G  97% 72°C torch 70.0G plan 71.0G" in p["gpus"].text
        queues = p["queues"].text.splitlines()
        assert queues[0] == "drafter-bound: targets blocked 71% of the time"
        assert queues[-1].startswith("hs           8/8   ")
        assert "loss 1.6986" in p["training"].text and "τ eval 2.87 @60" in p["training"].text
        # the plot is on a log scale, so early losses in the tens do not flatten the curve
        assert app.query_one("#loss-plot").data[-1] == pytest.approx(
            math.log(app.state.loss_history[-1]))
        errors = app.query_one("#errors")
        assert errors.table.row_count == 1
        assert "Traceback (most recent call last)" in errors.detail_text
        assert "hint: lower data.token_budget" in errors.detail_text
        log = app.query_one("#log", LogPanel).text
        assert "run ended: failed at step 60" in log and "state training -> failed" in log


async def test_cpu_only_run_shows_workers_and_host():
    events = sc.start(targets=["cpu:0"], drafters=["cpu:0"]) + [
        ev.WorkerStatus(worker="target-0", role="target", device="cpu", status="running",
                        ts=sc.T0 + 3),
        ev.WorkerStatus(worker="drafter-0", role="drafter", device="cpu", status="waiting",
                        ts=sc.T0 + 3),
        ev.HostSample(ram_used=3 * sc.GIB, ram_total=16 * sc.GIB, cpu_percent=180.0, ts=sc.T0 + 4)]
    app = DFlashApp(ReplayController(events))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        gpus = app.query_one("#gpus")
        assert gpus.border_title == "Workers (CPU)"
        assert gpus.text.splitlines() == [
            "target-0   cpu    running", "drafter-0  cpu    waiting", "host RAM 3.0/16.0G  CPU 180%"]


async def confirm(pilot, key: str, answer: str) -> None:
    await pilot.press(key)
    await pilot.pause()
    assert isinstance(pilot.app.screen, ConfirmScreen)
    await pilot.press(answer)
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()
    await settle(pilot)


async def test_s_asks_the_controller_for_every_workers_stack():
    ctl = ReplayController(sc.training(steps=5))
    app = DFlashApp(ctl)
    async with app.run_test(size=BIG) as pilot:
        await settle(pilot)
        await pilot.press("s")
        await pilot.app.workers.wait_for_complete()
        await settle(pilot)
        assert ctl.calls == ["start", "stacks"]  # no confirmation: it changes nothing
        assert any("no live threads" in line.text for line in app.state.log)


async def test_abort_and_restart_ask_first():
    ctl = ReplayController(sc.training(steps=5))
    app = DFlashApp(ctl)
    async with app.run_test(size=BIG) as pilot:
        await settle(pilot)
        await confirm(pilot, "a", "n")
        await confirm(pilot, "r", "escape")
        assert ctl.calls == ["start"] and ctl.state == "training"
        await confirm(pilot, "a", "y")
        assert ctl.calls == ["start", "abort"]
        assert "ABORTED" in app.query_one("#header").text
        await confirm(pilot, "r", "y")
        assert ctl.calls == ["start", "abort", "restart"]
        assert "PREFLIGHT" in app.query_one("#header").text
        assert app.is_running


@pytest.mark.parametrize("owns_run", [True, False])
async def test_a_restart_or_abort_asked_here_is_in_the_runs_records(owns_run):
    """The run's records (events.jsonl, train.log: sinks on the bus) say who restarted it; an
    attached dashboard leaves that to the owner's inbox ("... by an attached dashboard")."""
    ctl = ReplayController(sc.training(steps=5))
    published: list[ev.Event] = []
    ctl.bus.tap(published.append)
    app = DFlashApp(ctl, owns_run=owns_run)
    async with app.run_test(size=BIG) as pilot:
        await settle(pilot)
        await confirm(pilot, "r", "y")
        await confirm(pilot, "a", "y")
        assert ctl.calls == ["start", "restart", "abort"]
        logged = [e.message for e in published if isinstance(e, ev.Log) and e.source == "dashboard"]
        shown = [line.text for line in app.state.log]
    if owns_run:
        assert logged == ["restart requested from the dashboard",
                          "abort requested from the dashboard"]
        assert any("restart requested from the dashboard" in t for t in shown)
    else:
        assert logged == []


async def test_failing_command_is_an_error_not_a_crash():
    class Broken(ReplayController):
        def abort(self):
            raise RuntimeError("engine is wedged")

    app = DFlashApp(Broken(sc.training(steps=3)))
    async with app.run_test(size=BIG) as pilot:
        await settle(pilot)
        await confirm(pilot, "a", "y")
        errors = app.query_one("#errors")
        assert errors.table.row_count == 1
        assert "RuntimeError: engine is wedged" in errors.detail_text
        assert app.is_running


async def test_a_panel_that_cannot_draw_is_reported_not_fatal(monkeypatch):
    from dflash_tui.widgets.queues import QueuesPanel

    def broken(self, state, width):
        raise ValueError("bad glyph")

    monkeypatch.setattr(QueuesPanel, "draw", broken)
    app = DFlashApp(ReplayController(sc.training(steps=3)))
    async with app.run_test(size=BIG) as pilot:
        errors = app.query_one("#errors")
        # on a loaded machine the first redraws come late: wait for them, not a fixed time
        await wait_for(pilot, lambda: errors.table.row_count >= 1
                       and "loss " in app.query_one("#training").text, timeout=20)
        await settle(pilot, 0.5)  # the queues keep changing: still one report
        assert errors.table.row_count == 1  # reported once, though the queues changed often
        assert "ValueError: bad glyph" in errors.detail_text
        assert "loss " in app.query_one("#training").text and app.is_running


async def test_quit_when_finished_exits_at_once():
    ctl = ReplayController(sc.aborted())
    app = DFlashApp(ctl)
    async with app.run_test(size=BIG) as pilot:
        await settle(pilot)
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running
    assert app.return_code == 0 and "shutdown" not in ctl.calls


async def test_quit_when_live_confirms_then_shuts_down_off_the_ui_thread():
    gate = threading.Event()
    ctl = ReplayController(sc.training(steps=5), shutdown_gate=gate)
    app = DFlashApp(ctl)
    async with app.run_test(size=BIG) as pilot:
        await settle(pilot)
        await pilot.press("q")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        await pilot.pause()
        assert app.is_running and ctl.calls == ["start"]
        await pilot.press("q", "y")
        await wait_for(pilot, lambda: "shutdown" in ctl.calls)
        # shutdown is still blocking in its thread, and the screen still answers keys
        await pilot.press("l")
        assert app.is_running and isinstance(app.focused, LogPanel)
        gate.set()  # the engine has stopped: now the app exits
        await wait_for(pilot, lambda: not app.is_running, timeout=3)
    assert app.return_code == 0 and app.shutdown_done


async def test_focus_keys_and_help():
    app = DFlashApp(ReplayController(sc.failed()))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("e")
        assert isinstance(app.focused, DataTable)
        await pilot.press("l")
        assert isinstance(app.focused, LogPanel)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert app.screen.query_one("#help-text").content.row_count == len(KEYS)
        explained = {key for key, _ in KEYS}
        assert {b.key_display or b.key for b in DFlashApp.BINDINGS} | {"ctrl+p"} <= explained
        await pilot.press("a")  # the help is modal: no dialog opens behind it
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)


async def test_command_palette_has_dashboard_commands():
    ctl = ReplayController(sc.training(steps=3))
    app = DFlashApp(ctl)
    async with app.run_test(size=BIG) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"abort run")
        hits = app.screen.query_one(CommandList)
        await wait_for(pilot, lambda: hits.option_count > 0)  # the search runs in the background
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await pilot.pause()
        await app.workers.wait_for_complete()
        assert ctl.calls == ["start", "abort"]


async def test_error_from_an_engine_thread_shows_within_a_second():
    ctl = ReplayController(sc.training(steps=5))
    app = DFlashApp(ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        table = app.query_one("#errors").table
        assert table.row_count == 0
        threading.Thread(target=ctl.publish, args=(sc.oom_error(300),)).start()
        took = await wait_for(pilot, lambda: table.row_count == 1, timeout=1.0)
        assert took < 1.0
        await settle(pilot, 0.15)
        assert "err 1" in app.query_one("#header").text
        assert app.is_running


async def test_a_fast_run_is_coalesced_into_few_batches():
    class Counting(DFlashApp):
        batches = 0

        def on_engine_events(self, message: EngineEvents) -> None:
            type(self).batches += 1
            super().on_engine_events(message)

    ctl = ReplayController(sc.start())
    app = Counting(ctl)
    n = 20_000
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        Counting.batches = 0
        flood = [ev.QueueDepth(name="hs", depth=i % 9, capacity=8, ts=sc.T0 + 10) for i in range(n)]
        publisher = threading.Thread(target=lambda: [ctl.publish(e) for e in flood])
        publisher.start()
        await asyncio.get_running_loop().run_in_executor(None, publisher.join)
        await settle(pilot, 0.5)
        assert app.state.queues["hs"].depth == (n - 1) % 9
        assert 1 <= Counting.batches < 40  # ~8 a second, not one per event
        assert app.is_running


async def test_postmortem_of_the_previous_run_on_start(tmp_path):
    died = sc.failed()[:-1]  # no RunEnded: the process was killed
    (tmp_path / "events.jsonl").write_text("".join(e.to_json() + "\n" for e in died))
    ctl = ReplayController([])
    app = DFlashApp(ctl, run_dir=tmp_path, start=False)
    async with app.run_test(size=BIG) as pilot:
        await settle(pilot)
        assert ctl.calls == []  # start=False
        log = " ".join(app.query_one("#log", LogPanel).text.split())  # undo the wrapping
        assert "post-mortem: previous run qwen36-dflash" in log
        assert "ended without RunEnded" in log and "last step 60/6000" in log
        errors = app.query_one("#errors")
        assert errors.table.row_count == 1 and "(previous run)" in errors.detail_text
        assert "errors 0" in app.query_one("#header").text


async def test_log_lines_rewrap_when_the_terminal_is_resized():
    long = "word " * 60  # ~300 characters: several rows at any width here
    events = sc.start() + [ev.Log(source="engine", level="info", message=long.strip(), ts=sc.T0 + 2)]
    app = DFlashApp(ReplayController(events))
    async with app.run_test(size=(100, 40)) as pilot:
        await settle(pilot)
        log = app.query_one("#log", LogPanel)

        def rows_of_long_line():
            return sum(1 for line in log.text.splitlines() if "word" in line)

        narrow = rows_of_long_line()
        widest_narrow = max(len(line.rstrip()) for line in log.text.splitlines())
        await pilot.resize_terminal(200, 40)
        await settle(pilot, 0.5)
        wide = rows_of_long_line()
        assert narrow > wide >= 1  # re-wrapped to the wider panel
        assert max(len(line.rstrip()) for line in log.text.splitlines()) > widest_narrow
        assert " ".join(log.text.split()).count(" ".join(long.split())) == 1  # nothing repeated
        await pilot.resize_terminal(100, 40)
        await settle(pilot, 0.5)
        assert rows_of_long_line() == narrow


async def test_every_gpu_of_an_eight_gpu_node_is_in_view_at_80x24():
    app = DFlashApp(ReplayController(sc.node_2_6()))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        gpus = app.query_one("#gpus")
        lines = gpus.text.splitlines()
        assert len(lines) <= gpus.scrollable_content_region.height  # nothing scrolled away
        shown = " ".join(lines)
        for i, role in enumerate(["tgt"] * 2 + ["dft"] * 6):
            assert f"{i} {role}" in shown
        assert "93/95G" in shown and "R3" in shown  # the drafter near its limit, retrying


async def test_training_panel_shows_exact_tau_its_gap_and_acceptance_by_position():
    events = sc.training(steps=20)
    events.append(ev.Checkpoint(step=20, path="runs/x/checkpoints/step-20", seconds=0.0,
                                reason="best", tau=2.87, ts=events[-1].ts))
    app = DFlashApp(ReplayController(events))
    async with app.run_test(size=BIG) as pilot:
        await settle(pilot)
        text = app.query_one("#training").text
        assert "tau exact" in text and "2.87" in text and "accepted@k 83% 50%" in text
        assert "tf target 2.95  gap +0.08" in text  # the mismatch gap sits by what it compares
        assert "best step 20 τ 2.87" in app.query_one("#header").text


def toasts(app) -> list[str]:
    return [n.message for n in app._notifications]


async def test_keys_that_cannot_act_on_an_ended_run_say_so_at_once():
    ctl = ReplayController(sc.aborted())
    app = DFlashApp(ctl)
    async with app.run_test(size=BIG) as pilot:
        await settle(pilot)
        await pilot.press("a")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmScreen)  # no question about nothing
        assert "nothing to abort: the run is aborted" in toasts(app)
        await pilot.press("s")
        await pilot.pause()
        await pilot.app.workers.wait_for_complete()
        assert "no worker is running: the run is aborted" in toasts(app)
        assert ctl.calls == ["start"]  # neither reached the controller
        await pilot.press("r")  # a restart can act: it asks, saying what it will do
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        assert "The run is aborted" in app.screen.question and "step 60" in app.screen.question


async def test_a_restarted_finished_run_never_shows_an_earlier_step():
    ctl = ReplayController(sc.resumed_at_the_end())
    app = DFlashApp(ctl)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        header = app.query_one("#header").text
        assert "FINISHED" in header and "step 512/512" in header and "ends 8 epochs" in header
        training = app.query_one("#training").text
        assert "resumed at step 512, where it ends" in training.replace("\n", " ")


async def test_a_failed_start_says_why_each_panel_is_empty():
    app = DFlashApp(ReplayController(sc.failed_preflight()))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        p = panels(app)
        assert "FAILED" in p["header"].text and "(e: errors)" in p["header"].text
        assert len(p["header"].text.split("\n")[0]) <= 80
        flat = {k: w.text.replace("\n", " ") for k, w in p.items()}
        assert flat["gpus"] == "no GPU sampled: the run failed before loading"
        assert flat["targets"] == "no target loaded: the run failed before loading"
        assert flat["queues"] == "no queues: the run failed before loading"
        assert flat["training"] == "no step: the run failed before training"


class Owned:
    """What run_app reads of an engine it owned, once the app has exited."""

    def __init__(self, state, final=None, kind=""):
        self.state, self.final_status = state, final
        self.failure = ev.Error(error_kind=kind, source="engine", message="m") if kind else None


def test_the_dashboard_exits_with_the_code_headless_would():
    from dflash_tui.app import owned_exit_code

    assert owned_exit_code(Owned("finished", "finished")) == 0
    assert owned_exit_code(Owned("failed", "failed", "oom")) == 1
    assert owned_exit_code(Owned("failed", "failed", "config")) == 2  # as headless: input error
    assert owned_exit_code(Owned("failed", "failed", "data")) == 2  # unusable data: input too
    assert owned_exit_code(Owned("aborted", "aborted")) == 130  # q on a live run aborts it
    assert owned_exit_code(Owned("idle")) == 0  # nothing was started


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_after_an_evaluation_the_training_panel_keeps_its_plot_in_view(size):
    from textual.widgets import Sparkline

    app = DFlashApp(ReplayController(sc.evaluated()))
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        training = app.query_one("#training")
        plot = training.query_one(Sparkline)
        assert training.max_scroll_y == 0  # nothing scrolled out of the panel
        assert plot.display and plot.region.height >= 1
        assert training.content_region.contains_region(plot.region)
        text = training.text + "\n" + str(training.query_one(".caption").content)
        assert "39.012" in text and "1.106" in text  # the loss range, both ends
        accepted = next(x for x in text.split("\n") if "accepted@k" in x)
        # whole positions, as many as fit, and how many more there are: no number cut
        assert accepted.startswith("accepted@k 94% 84% 70%") and accepted.endswith(" more)")
        assert "…" not in accepted
        width = training.scrollable_content_region.width
        assert all(len(x) <= width for x in text.split("\n"))


async def test_help_fits_an_80x24_terminal_and_notices_leave_the_log_in_view():
    from textual.widgets._toast import Toast

    app = DFlashApp(ReplayController(sc.training()))
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("question_mark")
        await pilot.pause(0.3)
        box = app.screen.query_one("#help")
        assert box.max_scroll_y == 0  # its last paragraph too
        assert app.screen.query_one("#help-foot").region.bottom <= box.region.bottom
        await pilot.press("escape")
        await pilot.pause()
        app.notify("a notice", timeout=30)
        await pilot.pause(0.5)
        # notices show at the top, under the header, in one row: not over the log's newest lines
        toast = app.screen.query_one(Toast)
        log = app.query_one("#log")
        assert toast.region.height == 1 and toast.region.y >= 2
        assert not toast.region.overlaps(log.region)
