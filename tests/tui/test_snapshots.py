"""Reviewed pictures of the main states at 80x24 (tmux over SSH) and 160x48, a split target's at
80x24, 120x40 and 200x50. Each replays a fixed event list with fixed timestamps; the
dashboard's clock is event time, so elapsed/ETA are stable.
Regenerate with `pytest tests/tui/test_snapshots.py --snapshot-update` and look at the SVGs."""

from __future__ import annotations

import pytest
import tui_scenarios as sc
from textual.widgets import DataTable

from dflash_tui.app import DFlashApp
from dflash_tui.sources.replay import ReplayController

SIZES = {"80x24": (80, 24), "160x48": (160, 48)}
STATES = {"loading": sc.loading, "training": sc.training, "failed_oom": sc.failed,
          "aborted": sc.aborted}


def replayed(events):
    app = DFlashApp(ReplayController(events))

    async def until_shown(pilot) -> None:
        # every event folded in and drawn: sampled panels redraw within 1 s
        while app.state.now < events[-1].ts or len(app.buffer) or app._pending or any(
                t._require_update_dimensions or t._updated_cells for t in app.query(DataTable)):
            # (a table sizes its columns when idle: a row added in the first batch of events
            # is drawn with the labels' widths until then)
            await pilot.pause(0.05)
        await pilot.pause(0.3)

    return app, until_shown


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("state", STATES)
def test_snapshot(snap_compare, state, size):
    app, until_shown = replayed(STATES[state]())
    assert snap_compare(app, terminal_size=SIZES[size], run_before=until_shown)


@pytest.mark.parametrize("size", {"80x24": (80, 24), "120x40": (120, 40)})
def test_snapshot_eight_gpus_two_targets_six_drafters(snap_compare, size):
    app, until_shown = replayed(sc.node_2_6())
    assert snap_compare(app, terminal_size=(80, 24) if size == "80x24" else (120, 40),
                        run_before=until_shown)


def test_snapshot_two_nodes(snap_compare):
    app, until_shown = replayed(sc.two_nodes())
    assert snap_compare(app, terminal_size=(120, 40), run_before=until_shown)


# What the screen says of runs that end oddly: a config refused before loading (every panel says
# why it is empty, the header stays one line), a finished run restarted at its last step.
@pytest.mark.parametrize("size", {"80x24": (80, 24), "120x40": (120, 40)})
def test_snapshot_failed_preflight(snap_compare, size):
    app, until_shown = replayed(sc.failed_preflight())
    assert snap_compare(app, terminal_size=(80, 24) if size == "80x24" else (120, 40),
                        run_before=until_shown)


def test_snapshot_resumed_at_the_end(snap_compare):
    app, until_shown = replayed(sc.resumed_at_the_end())
    assert snap_compare(app, terminal_size=(80, 24), run_before=until_shown)


def test_snapshot_checkpoint_writing(snap_compare):
    app, until_shown = replayed(sc.checkpoint_writing())
    assert snap_compare(app, terminal_size=(120, 40), run_before=until_shown)


# Small terminals after an evaluation: at 80x24 the Training panel keeps loss, tok/s and the
# teacher-forced tau, the exact tau and its gap, as many accepted@k positions as fit, the loss
# range and one row of its plot (lr, grad, samples/s and padding give way); at 120x40 two rows of
# numbers and a taller plot. The loss range is never what is cut.
@pytest.mark.parametrize("size", {"80x24": (80, 24), "120x40": (120, 40)})
def test_snapshot_evaluated(snap_compare, size):
    app, until_shown = replayed(sc.evaluated())
    assert snap_compare(app, terminal_size=(80, 24) if size == "80x24" else (120, 40),
                        run_before=until_shown)


def test_snapshot_help_at_80x24(snap_compare):
    app, until_shown = replayed(sc.training())

    async def with_help(pilot) -> None:
        await until_shown(pilot)
        await pilot.press("question_mark")
        await pilot.pause(0.3)

    assert snap_compare(app, terminal_size=(80, 24), run_before=with_help)


# A target split over two ranks (target.gpus_per_copy 2): each rank a row of the targets panel,
# named by its rank; at 80x24 each row takes two lines so its numbers stay whole, at 120x40 and
# 200x50 one. The CPU demo's split (workers panel) as a new user first sees it.
SPLIT_SIZES = {"80x24": (80, 24), "120x40": (120, 40), "200x50": (200, 50)}


@pytest.mark.parametrize("size", SPLIT_SIZES)
def test_snapshot_split_target(snap_compare, size):
    app, until_shown = replayed(sc.split_target())
    assert snap_compare(app, terminal_size=SPLIT_SIZES[size], run_before=until_shown)


def test_snapshot_split_target_loading(snap_compare):
    app, until_shown = replayed(sc.split_target_loading())
    assert snap_compare(app, terminal_size=(80, 24), run_before=until_shown)


def test_snapshot_split_target_on_the_cpu_finished(snap_compare):
    app, until_shown = replayed(sc.split_target_finished(cpu=True))
    assert snap_compare(app, terminal_size=(80, 24), run_before=until_shown)
