"""The numbers a user acts on are never cut, at 80x24 and above: a panel too narrow for all of
them leaves whole fields out (the least important first) or wraps at a field's boundary; only
text from outside (an error message, a worker's detail, a path) may end in an ellipsis.

Read back as the screen draws each panel, for the runs the snapshots show (a target split over
two ranks among them) at 80x24, 120x40 and 200x50."""

from __future__ import annotations

import dataclasses

import pytest
import tui_scenarios as sc
from tui_screen import content_rows

from dflash_core.observe import events as ev
from dflash_tui import fmt
from dflash_tui.app import DFlashApp
from dflash_tui.sources.replay import ReplayController

pytestmark = pytest.mark.anyio

SIZES = [(80, 24), (120, 40), (200, 50)]
PANELS = ("header", "gpus", "targets", "queues", "nodes", "training")
SCENARIOS = {
    "split_loading": sc.split_target_loading,
    "split_training": sc.split_target,
    "split_finished": sc.split_target_finished,
    "split_cpu_finished": lambda: sc.split_target_finished(cpu=True),
    "training": sc.training,
    "evaluated": sc.evaluated,
    "failed": sc.failed,
    "two_nodes": sc.two_nodes,
    "eight_gpus": sc.node_2_6,
}
MIN_CUT = 3  # a cut of outside text shows at least this much of it


def outside_texts(events: list[ev.Event]) -> list[str]:
    """Text from outside the dashboard's own words, which a narrow panel may cut: messages,
    details, reasons, paths."""
    out: list[str] = []
    for e in events:
        for name in ("message", "detail", "reason", "path", "run_dir", "where", "error"):
            value = getattr(e, name, "")
            if isinstance(value, str) and value:
                out += [value, fmt.short_message(value)]
        if isinstance(e, ev.Error):
            out.append(f"[{e.error_kind}] {fmt.short_message(e.message)}")
    return out


def cut_numbers(rows: list[str], outside: list[str]) -> list[str]:
    """The rows that end in an ellipsis where no outside text was cut: a number, a label or
    the dashboard's own words were."""
    bad = []
    for row in rows:
        if not row.endswith("…"):
            continue
        shown = row[:-1].rstrip(". ")
        if not any(shown.endswith(text[:k]) for text in outside
                   for k in range(len(text), MIN_CUT - 1, -1)):
            bad.append(row)
    return bad


async def drawn(pilot, app, events) -> None:
    while app.state.now < events[-1].ts or len(app.buffer) or app._pending:
        await pilot.pause(0.05)
    await pilot.pause(0.3)
    assert app._broken == set()  # a panel that failed to draw shows no numbers to check


@pytest.mark.parametrize("name", SCENARIOS)
async def test_no_number_is_cut_at_80x24_and_above(name):
    events = SCENARIOS[name]()
    outside = outside_texts(events)
    app = DFlashApp(ReplayController(events))
    async with app.run_test(size=SIZES[0]) as pilot:
        await drawn(pilot, app, events)
        cut = {}
        for size in SIZES:
            await pilot.resize_terminal(*size)
            await pilot.pause(0.5)
            for panel in PANELS:
                widget = app.query_one(f"#{panel}")
                if widget.display:
                    bad = cut_numbers(content_rows(app, widget), outside)
                    if bad:
                        cut[f"{size[0]}x{size[1]} {panel}"] = bad
        assert app._broken == set()
        assert not cut, cut


def rows_of(app, panel: str) -> str:
    return "\n".join(content_rows(app, app.query_one(f"#{panel}")))


async def test_a_split_targets_ranks_keep_their_rank_and_numbers_at_every_size():
    events = sc.split_target()
    app = DFlashApp(ReplayController(events))
    async with app.run_test(size=SIZES[0]) as pilot:
        await drawn(pilot, app, events)
        for size in SIZES:
            await pilot.resize_terminal(*size)
            await pilot.pause(0.5)
            text = rows_of(app, "targets")
            for rank, rate in ((0, "9.3k"), (1, "9.2k")):
                assert f"target-{rank} " in text and f"rank {rank}/2" in text, (size, text)
                assert f"{rate} tok/s" in text, (size, text)
            assert "blocked 4%" in text and "starved 27%" in text, (size, text)
            assert "all targets 18.4k tok/s" in text, (size, text)


async def test_the_demos_split_target_on_the_cpu_keeps_each_ranks_state():
    """`dflash-tui demo --device cpu --set 'layout.targets=[0, 1]' --set
    target.gpus_per_copy=2`: the workers panel names each rank and how it ended."""
    events = sc.split_target_finished(cpu=True)
    app = DFlashApp(ReplayController(events))
    async with app.run_test(size=SIZES[0]) as pilot:
        await drawn(pilot, app, events)
        for size in SIZES:
            await pilot.resize_terminal(*size)
            await pilot.pause(0.5)
            workers = rows_of(app, "gpus")
            targets = rows_of(app, "targets")
            for rank in (0, 1):
                assert f"rank {rank}/2" in workers and f"rank {rank}/2" in targets, size
            assert workers.count("stopped") == 3, (size, workers)
            assert "last 9.3k tok/s" in targets and "last 9.2k tok/s" in targets, (size, targets)


async def test_an_evaluations_taus_and_gap_stay_whole_at_every_size():
    events = sc.training()
    app = DFlashApp(ReplayController(events))
    async with app.run_test(size=SIZES[0]) as pilot:
        await drawn(pilot, app, events)
        for size in SIZES:
            await pilot.resize_terminal(*size)
            await pilot.pause(0.5)
            text = rows_of(app, "training")
            assert "tau exact" in text and "2.87" in text and "gap +0.08" in text, (size, text)
            assert "accepted@k 83% 50%" in text, (size, text)
            if size[0] >= 120:  # room for every measure
                for measure in ("tf target 2.95", "tf held-out 3.58", "tf train 3.74",
                                "labels = target 98%"):
                    assert measure in text, (size, text)


async def test_accepted_at_k_shows_whole_positions_and_says_how_many_are_left_out():
    events = sc.evaluated()
    app = DFlashApp(ReplayController(events))
    async with app.run_test(size=SIZES[0]) as pilot:
        await drawn(pilot, app, events)
        for size in SIZES:
            await pilot.resize_terminal(*size)
            await pilot.pause(0.5)
            line = next(x for x in content_rows(app, app.query_one("#training"))
                        if x.startswith("accepted@k"))
            values = line.removeprefix("accepted@k ").split(" (")[0].split()
            shown = [f"{r:.0%}" for r in app.state.accepted_by_position()][:len(values)]
            assert values == shown, (size, line)
            left = 15 - len(values)
            assert line.endswith(f"({left} more)") if left else "more" not in line, (size, line)
            if size[0] >= 200:
                assert left == 0, line


def test_a_finding_is_never_what_gives_way():
    from dflash_tui.widgets.training import eval_lines

    events = [dataclasses.replace(e, findings=["mismatch"]) if isinstance(e, ev.EvalResult)
              else e for e in sc.evaluated()]
    s = sc.fold(events)
    for width in (38, 55, 95):
        text = "\n".join(x.plain for x in eval_lines(s, width))
        assert "mismatch" in text, width
        assert all(len(x.plain) <= width for x in eval_lines(s, width))
