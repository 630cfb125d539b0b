"""The run's device time end to end on the CPU: DeviceHours events from the start to the end (an
evaluation's figure right before its result), the figure in each checkpoint, and a resume that
goes on from its checkpoint's figure while the run folder's record keeps what the abort lost."""

import json

import pytest

from dflash_core.observe.device_hours import RECORD_KEY, Figure
from dflash_core.checkpoint.layout import STATE_PATH
from dflash_core.persist.hours_ledger import read_checkpoint_figure
from dflash_core.observe.event_log import read_events
from dflash_core.observe.events import DeviceHours, EvalResult, RunEnded, StepMetrics
from dflash_core.persist.hours_ledger import read_held
from dflash_core.pipeline.engine import Engine

from ..engine_fixtures import assets, make_config, run_to_end  # noqa: F401 - a fixture

SLACK_S = 1.0  # the figure is taken a moment before RunEnded's seconds


def test_a_run_records_its_device_hours_in_events_and_checkpoints(tmp_path, assets):
    target, data = assets
    cfg = make_config(tmp_path, target, data, cost__gpu_hour_price=2.0)
    rec = run_to_end(Engine(cfg))
    hours = rec.of(DeviceHours)
    ended = rec.of(RunEnded)[0]
    assert ended.status == "finished"
    assert hours[0].reason == "periodic" and hours[-1].reason == "end"
    end = hours[-1]
    # CPU: the host, one device, held from the run's start to its end; no GPU-hours, no money
    assert end.gpu_hours == 0 and end.devices == 1
    assert end.host_hours * 3600 == pytest.approx(ended.seconds, abs=SLACK_S)
    # one target and one drafter worker share the host equally
    assert end.host_target == pytest.approx(end.host_drafter)
    assert end.price == 2.0 and end.currency == "USD" and end.step == ended.step
    assert [h.host_hours for h in hours] == sorted(h.host_hours for h in hours)

    # the evaluation's figure comes right before its result, at its step
    kinds = [type(e) for e in rec.events]
    first_eval = kinds.index(EvalResult)
    before = [e for e in rec.events[:first_eval] if isinstance(e, DeviceHours)][-1]
    assert before.reason == "eval" and before.step == rec.of(EvalResult)[0].step

    # each checkpoint records the figure when its state was taken
    step3 = read_checkpoint_figure(cfg.run_dir / "checkpoints" / "step-3")
    step6 = read_checkpoint_figure(cfg.run_dir / "checkpoints" / "step-6")
    assert step3 is not None and step6 is not None
    assert 0 < step3.host < step6.host <= end.host_hours
    assert step6.price == 2.0 and step6.gpu == 0

    # events.jsonl holds them; the run folder's record holds the whole run's time
    replay = [e for e in read_events(cfg.run_dir / "events.jsonl") if isinstance(e, DeviceHours)]
    assert [e.reason for e in replay] == [e.reason for e in hours]
    assert read_held(cfg.run_dir)[1] == pytest.approx(end.host_hours)
    assert "device time at the end of step 6" in (cfg.run_dir / "train.log").read_text()


def test_a_resume_goes_on_from_the_checkpoints_figure(tmp_path, assets):
    target, data = assets
    cfg = make_config(tmp_path, target, data, data__eval_prompts=0)
    first = Engine(cfg)
    first.bus.tap(lambda e: first.abort() if isinstance(e, StepMetrics) and e.step == 3 else None)
    rec1 = run_to_end(first)
    assert rec1.of(RunEnded)[0].status == "aborted"
    end1 = rec1.of(DeviceHours)[-1]
    saved = read_checkpoint_figure(cfg.run_dir / "checkpoints" / "step-3")
    assert 0 < saved.host <= end1.host_hours

    second = Engine(cfg, resume=True)
    rec2 = run_to_end(second)
    ended = rec2.of(RunEnded)[0]
    assert ended.status == "finished"
    end2 = rec2.of(DeviceHours)[-1]
    # the checkpoint's figure plus this segment's whole time
    assert end2.host_hours * 3600 == pytest.approx(saved.host * 3600 + ended.seconds,
                                                   abs=SLACK_S)
    # what the first segment held after its checkpoint was taken: lost to the figure, kept by
    # the run folder's record
    assert end2.lost_host == pytest.approx(end1.host_hours - saved.host, abs=1e-9)
    assert read_held(cfg.run_dir)[1] == pytest.approx(end2.host_hours + end2.lost_host)
    final = json.loads((cfg.run_dir / "checkpoints" / "step-6" / STATE_PATH)
                       .read_text())["trainer"][RECORD_KEY]
    assert Figure.from_record(final).host > saved.host
    assert any("resume: device time so far" in getattr(e, "message", "") for e in rec2.events)
