"""A DFlash2 run on the dashboard: the training panel shows its loss terms and the selector's
hit rate (how often the label was among its K candidates), and the evaluation line the unary
argmax's tau beside exact tau."""

from __future__ import annotations

import dataclasses

import pytest
import tui_scenarios as sc

from dflash_core import acceptance
from dflash_core.observe import events as ev
from dflash_tui.app import DFlashApp
from dflash_tui.sources.replay import ReplayController

BIG = (160, 48)


def dflash2_run() -> list[ev.Event]:
    out = []
    for e in sc.training(steps=20):
        if isinstance(e, ev.StepMetrics):
            e = dataclasses.replace(e, loss_ce=1.25, loss_sel=0.375, loss_hit=0.875)
        elif isinstance(e, ev.EvalResult):
            e = dataclasses.replace(e, tau_unary=2.5)
        out.append(e)
    return out


@pytest.mark.anyio
async def test_training_panel_shows_the_selectors_terms_and_hit_rate():
    app = DFlashApp(ReplayController(dflash2_run()))
    async with app.run_test(size=BIG) as pilot:
        await pilot.pause(1.2)
        text = app.query_one("#training").text
    assert "ce 1.250" in text and "sel 0.375" in text and "hit 0.875" in text
    assert "tv " not in text


def test_the_evaluation_line_has_the_unary_argmax_beside_exact_tau():
    e = next(x for x in dflash2_run() if isinstance(x, ev.EvalResult))
    line = acceptance.summary_line(e)
    assert f"{acceptance.UNARY.label} 2.50" in line
    assert line.index("tau exact") < line.index(acceptance.UNARY.label)
    plain = dataclasses.replace(e, tau_unary=-1.0)
    assert acceptance.UNARY.label not in acceptance.summary_line(plain)
