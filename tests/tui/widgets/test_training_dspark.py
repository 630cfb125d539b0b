"""A DSpark run on the dashboard: the training panel shows its loss's three terms and the
evaluation lines the confidence head's calibration in the words acceptance.calibration_* use; a
DFlash run shows neither."""

from __future__ import annotations

import dataclasses

import pytest
import tui_scenarios as sc

from dflash_core import acceptance
from dflash_core.models.dspark.calibration import calibrate
from dflash_core.observe import events as ev
from dflash_tui.app import DFlashApp
from dflash_tui.sources.replay import ReplayController

BIG = (160, 48)
CAL = calibrate([[0.9, 0.8, 0.3], [0.95, 0.5, 0.2], [0.6, 0.4, 0.1]], [2, 1, 0])


def dspark_run() -> list[ev.Event]:
    """The scenario's run with DSpark's terms on every step and a calibrated evaluation."""
    out = []
    for e in sc.training(steps=20):
        if isinstance(e, ev.StepMetrics):
            e = dataclasses.replace(e, loss_ce=2.125, loss_tv=0.75, loss_conf=0.5)
        elif isinstance(e, ev.EvalResult):
            e = dataclasses.replace(e, calibration=CAL.as_dict())
        out.append(e)
    return out


@pytest.mark.anyio
async def test_training_panel_shows_terms_and_calibration():
    app = DFlashApp(ReplayController(dspark_run()))
    async with app.run_test(size=BIG) as pilot:
        await pilot.pause(1.2)
        text = app.query_one("#training").text
    assert "ce 2.125" in text and "tv 0.750" in text and "conf 0.500" in text
    fields = dict(acceptance.calibration_fields(CAL))
    assert f"{acceptance.ECE.label} {fields['ECE']}" in text
    assert f"tau@2 {fields['tau@2']}" in text
    assert f"{acceptance.CONFIDENCE.label} " in text


@pytest.mark.anyio
async def test_a_dflash_run_shows_neither():
    app = DFlashApp(ReplayController(sc.training(steps=20)))
    async with app.run_test(size=BIG) as pilot:
        await pilot.pause(1.2)
        text = app.query_one("#training").text
    assert "loss " in text
    assert "ce " not in text and "ECE" not in text and "confidence@k" not in text
