"""A DSpark run in the report: the summary shows the latest loss terms, the acceptance table the
confidence head's calibration in the words acceptance.calibration_* use; a DFlash run neither."""

from __future__ import annotations

import dataclasses

import tui_scenarios as sc

from dflash_core import acceptance
from dflash_core.models.dspark.calibration import calibrate
from dflash_core.observe import events as ev
from dflash_tui import report

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


def test_report_shows_terms_and_calibration(tmp_path):
    with open(tmp_path / "events.jsonl", "w", encoding="utf-8") as f:
        f.writelines(e.to_json() + "\n" for e in dspark_run())
    html = report.render_html(report.read_run(tmp_path))
    rows = acceptance.calibration_rows(CAL)
    assert [r[0] for r in rows] == ["confidence@k", "ECE", "tau@2", "tau@3"]
    for label, value, _ in rows:
        assert f"<td>{label}</td><td>{value}</td>" in html, label
    assert "<th>latest loss terms</th><td>ce 2.1250, tv 0.7500, conf 0.5000</td>" in html
    plain = report.render_html(report.read_run(_dflash(tmp_path)))
    assert "latest loss terms" not in plain and "<td>ECE</td>" not in plain


def _dflash(tmp_path):
    folder = tmp_path / "dflash"
    folder.mkdir()
    with open(folder / "events.jsonl", "w", encoding="utf-8") as f:
        f.writelines(e.to_json() + "\n" for e in sc.training(steps=20))
    return folder
