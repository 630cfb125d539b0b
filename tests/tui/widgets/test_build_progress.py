"""The demo target's build (minutes on first use) shows in the header and the targets panel,
fed through the event stream as the engine publishes it, and goes once it is done."""

import pytest
import tui_scenarios as sc

from dflash_core.observe import events as ev
from dflash_tui.app import DFlashApp
from dflash_tui.sources.replay import ReplayController

pytestmark = pytest.mark.anyio
SHOWN = "building demo target 40% (step 240/600, loss 2.10)"


def preflight():
    return [e for e in sc.start() if not (isinstance(e, ev.StateChanged) and e.state == "loading")
            and not isinstance(e, ev.MemoryPlan)]


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_the_build_shows_in_the_header_and_the_targets_panel(size):
    ctl = ReplayController(preflight())
    app = DFlashApp(ctl)
    async with app.run_test(size=size) as pilot:
        await pilot.pause(1.2)  # sampled panels redraw within 1 s
        assert "no target workers yet" in app.query_one("#targets").text
        ctl.publish(ev.BuildProgress(what="demo target", fraction=0.4,
                                     message="demo target step 240/600, loss 2.10"))
        await pilot.pause(1.2)  # sampled panels redraw within 1 s
        header, targets = app.query_one("#header").text, app.query_one("#targets").text
        assert SHOWN in header
        assert SHOWN in " ".join(targets.split()) and "█" in targets  # wrapped, never cut
        assert "made once, then reused" in " ".join(targets.split())
        ctl.publish(ev.BuildProgress(what="demo target", fraction=1.0,
                                     message="demo target ready (loss 2.00)"))
        await pilot.pause(1.2)  # sampled panels redraw within 1 s
        assert "building" not in app.query_one("#header").text
        assert "no target workers yet" in app.query_one("#targets").text


async def test_a_build_cut_short_by_the_runs_end_is_not_shown_after_it():
    ctl = ReplayController(preflight() + [
        ev.BuildProgress(what="demo data", fraction=0.5, message="generating 256 demo samples")])
    app = DFlashApp(ctl)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(1.2)  # sampled panels redraw within 1 s
        assert "building demo data 50% (generating 256 demo samples)" in \
            app.query_one("#header").text
        ctl.abort()
        await pilot.pause(1.2)  # sampled panels redraw within 1 s
        assert "building" not in app.query_one("#header").text
        assert "building" not in app.query_one("#targets").text
