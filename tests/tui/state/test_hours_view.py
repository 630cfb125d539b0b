"""The dashboard's device time: the last DeviceHours figure moved on with the live clock, in the
header; a replay's clock stands; files without it show nothing."""

from __future__ import annotations

import pytest
import tui_scenarios as sc
from dflash_core.observe import events as ev
from dflash_tui.state.dashboard import DashboardState
from dflash_tui.state.hours import header_text, hours_now
from tui_scenarios import fold


def header(s: DashboardState, width: int = 160) -> str:
    from dflash_tui.widgets.header import HeaderBar

    return HeaderBar.draw(s, width, 3).plain


def gpu_figure(t: float, price: float = 0.0) -> ev.DeviceHours:
    # 8 GPUs: 7 targets, 1 drafter, after a quarter of an hour
    return ev.DeviceHours(step=5, gpu_target=1.75, gpu_drafter=0.25, devices=8, price=price,
                          currency="USD", ts=sc.T0 + t)


def test_the_header_shows_gpu_hours_and_money_moving_on_with_a_live_run():
    s = fold(sc.training(steps=5) + [gpu_figure(130, price=3.0)])
    assert header_text(s) == "2 GPU-h 6.00 USD"
    assert "cost 2 GPU-h 6.00 USD" in header(s)
    # 15 s later on the live clock: 8 GPUs held 15 s more
    s.tick(sc.T0 + 145)
    f = hours_now(s)
    assert f.gpu == pytest.approx(2.0 + 8 * 15 / 3600)
    assert f.gpu_target / f.gpu == pytest.approx(1.75 / 2.0)  # the roles' split kept
    assert header_text(s) == "2.03 GPU-h 6.10 USD"


def test_an_ended_run_shows_its_last_figure():
    events = sc.aborted()
    events.insert(-1, gpu_figure(events[-1].ts - sc.T0 - 1))
    s = fold(events)
    assert not s.live
    s.now += 3600  # a clock that goes on must not add hours to a run that ended
    assert hours_now(s).gpu == pytest.approx(2.0)


def test_a_cpu_run_shows_host_hours():
    s = fold(sc.start(targets=["cpu:0"], drafters=["cpu:0"]) + [
        ev.DeviceHours(step=1, host_target=0.005, host_drafter=0.005, devices=1,
                       ts=sc.T0 + 30)])
    assert header_text(s) == "0.01 host-h (CPU)"


def test_an_events_file_without_device_hours_shows_none():
    s = fold(sc.failed())
    assert s.hours is None and header_text(s) == ""
    assert "cost" not in header(s)
