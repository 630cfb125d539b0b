"""Text from outside the dashboard (error messages, hints, tracebacks, log lines, run names,
paths, worker names, stall reports, findings, prompt sets, config values, notices) shows as it
is: brackets are never read as Textual or Rich markup. A gloo error always holds one
("[/__w/pytorch/...pair.cc:553]"), and read as markup it closed the dashboard with a MarkupError
in run, attach and replay alike.

Each field gets its own tag and one of the markups (a closing tag with no opening one, a style, a
link, a styled span), and each pane is read back as the screen draws it."""

from __future__ import annotations

import pytest
import tui_scenarios as sc
from textual.widgets._toast import Toast
from tui_screen import content_rows, shown

from dflash_core.observe import events as ev
from dflash_tui.app import DFlashApp
from dflash_tui.screens import ConfirmScreen
from dflash_tui.sources.follow import FollowController
from dflash_tui.sources.replay import ReplayController

pytestmark = pytest.mark.anyio

T0 = sc.T0
WIDE = (240, 72)  # every pane wide enough to show each field whole
GLOO = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
        "Connection closed by peer [127.0.0.1]:29500")
# One field each: what the event carries is what must show.
F = {
    "run": "run[bold]",
    "dir": "runs/[/x]",
    "wandb": "wb[link=https://e.x]",
    "alloc": "al[red]x[/red]",
    "target": "tgt[/x]",
    "device": "cpu:0 [bold]",
    "warm_target": "tw[link=https://e.x]",
    "warm": "first [red]x[/red] forward",
    "stall_worker": "drafter-[/x]",
    "stall_where": "compiling [bold]where",
    "queue": "q[link=https://e.x]",
    "finding": "find[/x]",
    "set": "gsm[bold]",
    "best_set": "best[red]x[/red]",
    "ckpt": "ckpt/[/x]/step-2",
    "node_host": "host[link=https://e.x]",
    "node_error": "nodeerr [/x] [bold]",
    "log_source": "logsrc[bold]",
    "log": "log [/x] [link=https://e.x] [red]x[/red]",
    "source": "src[/x]",
    "phase": "ph[bold]",
    "err_device": "dev[link=https://e.x]",
    "message": GLOO,
    "hint": "hint [red]x[/red] [/x]",
    "traceback_line": '  File "[/x]/gloo.py", line 1, in [bold]',
    "reason": "why [/x] [link=https://e.x]",
    "notice": "notice [/x] [bold] [link=https://e.x] [red]x[/red]",
}
TRACEBACK = f"Traceback (most recent call last):\n{F['traceback_line']}\n{GLOO}\n"


def live_events() -> list[ev.Event]:
    """A CPU run with every field of a live run: loading, warming up, training, evaluated, a
    stall, a second node, a log line."""
    t = T0
    out: list[ev.Event] = [
        ev.RunStarted(run_name=F["run"], run_dir=F["dir"], config={}, targets=["cpu:0"],
                      drafters=["cpu:0"], total_steps=100, allocator=F["alloc"], ts=t),
        ev.StateChanged(state="preflight", previous="idle", ts=t),
        ev.SinkStatus(sink="wandb", status="ok", detail=F["wandb"], ts=t + 1),
        ev.StateChanged(state="loading", previous="preflight", ts=t + 2),
        ev.WorkerStatus(worker=F["target"], role="target", device=F["device"],
                        status=ev.WORKER_LOADING, ts=t + 3),
        ev.LoadProgress(worker=F["target"], device=F["device"], bytes_loaded=sc.GIB,
                        bytes_total=4 * sc.GIB, shards_loaded=1, shards_total=4, seconds=3.0,
                        ts=t + 4),
        ev.WorkerStatus(worker=F["warm_target"], role="target", device="cpu:0",
                        status=ev.WORKER_WARMUP, detail=F["warm"], ts=t + 5),
        ev.WorkerStatus(worker="drafter-0", role="drafter", device="cpu:0",
                        status=ev.WORKER_WARMUP, detail=F["warm"], ts=t + 5),
        ev.StateChanged(state="training", previous="loading", ts=t + 6),
        ev.QueueDepth(name=F["queue"], depth=1, capacity=4, ts=t + 7),
        ev.StepMetrics(step=2, epoch=0, loss=2.5, lr=1e-4, grad_norm=0.5, tokens_per_s=900.0,
                       samples_per_s=2.0, tau_tf=2.0, ts=t + 8),
        ev.EvalResult(step=2, tau=2.87, acceptance=[1, 2, 3], prompts=4, findings=[F["finding"]],
                      ts=t + 9),
        ev.EvalResult(step=2, tau=2.25, acceptance=[3, 1, 1], prompts=4, prompt_set=F["set"],
                      ts=t + 9),
        ev.Checkpoint(step=2, path=F["ckpt"], seconds=0.0, reason="best", tau=2.25,
                      prompt_set=F["best_set"], ts=t + 9),
        ev.NodeStatus(node=0, host="node-0", step=2, ts=t + 9),
        ev.NodeStatus(node=1, host=F["node_host"], step=2, error=F["node_error"], ts=t + 9),
        ev.Stall(worker=F["stall_worker"], phase="warmup", seconds=60.0, where=F["stall_where"],
                 stack="", ts=t + 10),
        ev.Log(level="warning", source=F["log_source"], message=F["log"], ts=t + 10),
    ]
    return out


def failure_events(t: float = T0 + 11) -> list[ev.Event]:
    """The gloo failure that used to close the dashboard, and the run's end it causes."""
    return [
        ev.Error(error_kind="internal", source=F["source"], phase=F["phase"],
                 device=F["err_device"], message=F["message"], hint=F["hint"],
                 traceback=TRACEBACK, ts=t),
        ev.StateChanged(state="failed", previous="training", reason=F["reason"], ts=t + 1),
        ev.RunEnded(status="failed", step=2, seconds=12.0, reason=F["reason"], ts=t + 1),
    ]


def flat(text: str) -> str:
    return " ".join(text.split())


def pane(app, name: str) -> str:
    """The pane as drawn, its rows joined: a wrapped line (the log, the error's detail) reads
    as one."""
    return flat(" ".join(content_rows(app, app.query_one(f"#{name}"))))


def assert_shown(app, name: str, *keys: str) -> None:
    text = pane(app, name)
    missing = [F[k] for k in keys if flat(F[k]) not in text]
    assert not missing, f"{name} pane lacks {missing}:\n{text}"


def assert_unbroken(app) -> None:
    """No panel failed to draw (a drawing error is caught and reported, never seen as text)."""
    assert app._broken == set()
    assert not [x for x in app.state.errors if x.event.source.startswith("dashboard")]


async def until(pilot, predicate, timeout: float = 4.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if predicate():
            break
        await pilot.pause(0.05)
    await pilot.pause(1.0)  # sampled panels redraw within a second


async def test_every_pane_shows_outside_text_literally():
    ctl = ReplayController(live_events())
    app = DFlashApp(ctl)
    async with app.run_test(size=WIDE, notifications=True) as pilot:
        await until(pilot, lambda: app.state.stalls)
        assert_unbroken(app)
        assert_shown(app, "header", "run", "dir", "wandb", "alloc", "stall_worker", "best_set")
        assert_shown(app, "targets", "target", "device", "warm_target", "warm")
        assert_shown(app, "gpus", "target", "warm_target", "warm")  # the CPU workers
        assert_shown(app, "queues", "queue")
        assert_shown(app, "training", "finding", "set")
        assert_shown(app, "nodes", "node_host", "node_error")
        assert_shown(app, "log", "log_source", "log", "stall_where", "ckpt", "node_error")

        for e in failure_events():
            ctl.publish(e)
        await until(pilot, lambda: app.state.state == "failed")
        assert_unbroken(app)
        # the table's row, the selected error in full below it, and its log line
        assert_shown(app, "errors", "source", "phase", "err_device", "message", "hint",
                     "traceback_line")
        assert flat("[internal] " + GLOO) in pane(app, "log")
        assert F["reason"] in pane(app, "header")

        app.notify(F["notice"], timeout=30)
        await pilot.pause(0.3)
        toasts = "\n".join("\n".join(shown(app, t)) for t in app.screen.query(Toast))
        assert F["notice"] in toasts

        app.push_screen(ConfirmScreen(F["notice"]))
        await pilot.pause(0.3)
        assert F["notice"] in "\n".join(shown(app, app.screen.query_one("#question")))
        assert app.is_running


def write(path, events) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for e in events:
            f.write(e.to_json() + "\n")


async def test_replay_of_an_events_file_with_markup_shows_it(tmp_path):
    """`dflash-tui replay`: the events come back from events.jsonl (JSON, not the objects)."""
    path = tmp_path / "events.jsonl"
    write(path, live_events() + failure_events())
    app = DFlashApp(ReplayController.from_jsonl(path))
    async with app.run_test(size=WIDE) as pilot:
        await until(pilot, lambda: app.state.state == "failed")
        assert_unbroken(app)
        assert_shown(app, "errors", "source", "message", "hint", "traceback_line")
        assert_shown(app, "header", "run", "dir")
        assert F["reason"] in pane(app, "header")
        assert app.is_running


async def test_attach_to_a_run_with_markup_shows_it(tmp_path):
    """`dflash-tui attach RUN_DIR`: the events are followed as the file grows, read-only."""
    write(tmp_path / "events.jsonl", live_events())
    ctl = FollowController(tmp_path, poll_s=0.02)
    app = DFlashApp(ctl, read_only=True)
    async with app.run_test(size=WIDE) as pilot:
        await until(pilot, lambda: app.state.stalls)
        with open(tmp_path / "events.jsonl", "a", encoding="utf-8") as f:
            for e in failure_events():
                f.write(e.to_json() + "\n")
        await until(pilot, lambda: app.state.state == "failed")
        assert_unbroken(app)
        assert_shown(app, "errors", "source", "message", "hint", "traceback_line")
        assert_shown(app, "log", "log")
        assert app.is_running
        await pilot.press("q")  # detaches: the followed run is not this process's


async def test_a_previous_runs_error_with_markup_shows_on_start(tmp_path):
    """The post-mortem of a run that died (no RunEnded) puts its last error in the panes."""
    died = live_events() + failure_events()[:1]
    write(tmp_path / "events.jsonl", died)
    app = DFlashApp(ReplayController([]), run_dir=tmp_path, start=False)
    async with app.run_test(size=WIDE) as pilot:
        await pilot.pause(0.5)
        assert_unbroken(app)
        assert_shown(app, "errors", "source", "message", "hint")
        assert_shown(app, "log", "hint")
        assert app.is_running
