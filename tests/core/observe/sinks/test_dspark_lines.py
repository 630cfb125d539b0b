"""DSpark in the records: a step's three loss terms and an evaluation's calibration travel through
events.jsonl (older lines without them still load) into train.log and W&B in the words
acceptance.calibration_* use."""

from __future__ import annotations

from types import SimpleNamespace

from dflash_core.acceptance import calibration_line, calibration_wandb
from dflash_core.models.dspark.calibration import Calibration, calibrate
from dflash_core.observe.events import EvalResult, StepMetrics, from_json
from dflash_core.observe.sinks.textlog import format_event
from dflash_core.observe.sinks.wandb_sink import WandbSink
from dflash_core.config import WandbConfig



class FakeRun:
    """What the sink calls on a wandb run: log() is recorded."""

    def __init__(self):
        self.logged, self.summary, self.url = [], {}, None
        self.dir = "/fake/wandb/offline-run-x/files"

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self, exit_code=None):
        pass


def fake_wandb(run):
    return SimpleNamespace(Settings=lambda **kw: dict(kw), init=lambda **kw: run)

# Four rounds of three drafts: what exact decoding recorded (confidences, drafts accepted).
CONF = [[0.9, 0.8, 0.3], [0.95, 0.5, 0.2], [0.6, 0.4, 0.1], [0.99, 0.9, 0.8]]
ACCEPTED = [2, 1, 0, 3]


def _step(**terms):
    return StepMetrics(step=3, epoch=0, loss=1.5, lr=1e-3, grad_norm=0.5, tokens_per_s=10.0,
                       samples_per_s=1.0, tau_tf=2.0, **terms)


def _eval(with_calibration=True):
    cal = calibrate(CONF, ACCEPTED).as_dict() if with_calibration else {}
    return EvalResult(step=3, tau=2.5, acceptance=[1, 1, 1, 1], prompts=2, calibration=cal)


def test_events_carry_terms_and_calibration_and_old_lines_load():
    step = _step(loss_ce=2.25, loss_tv=0.5, loss_conf=0.125)
    assert from_json(step.to_json()) == step
    ev = _eval()
    back = from_json(ev.to_json())
    assert back == ev
    cal = Calibration.from_dict(back.calibration)
    assert cal == calibrate(CONF, ACCEPTED)
    assert [b.drafts for b in cal.budgets] == [2, 3]
    # a line written before these fields existed
    old = ('{"ts":1.0,"step":3,"epoch":0,"loss":1.5,"lr":0.001,"grad_norm":0.5,'
           '"tokens_per_s":10.0,"samples_per_s":1.0,"tau_tf":2.0,"event":"StepMetrics"}')
    assert from_json(old).loss_ce == -1.0
    old_eval = '{"ts":1.0,"step":3,"tau":2.5,"acceptance":[1,1],"prompts":2,"event":"EvalResult"}'
    assert Calibration.from_dict(from_json(old_eval).calibration) is None


def test_train_log_shows_the_terms_and_the_calibration():
    line = format_event(_step(loss_ce=2.25, loss_tv=0.5, loss_conf=0.125))
    assert "loss 1.5000 (ce 2.2500 tv 0.5000 conf 0.1250) lr" in line
    assert "(ce" not in format_event(_step())  # DFlash: no terms
    text = format_event(_eval())
    want = calibration_line(calibrate(CONF, ACCEPTED))
    assert want.startswith("confidence@k ") and "ECE " in want and "tau@2 " in want
    assert text.endswith("; " + want)
    assert "confidence@k" not in format_event(_eval(with_calibration=False))


def test_wandb_logs_the_terms_and_the_calibration(tmp_path):
    run = FakeRun()
    sink = WandbSink(WandbConfig(enabled=True), tmp_path, "r", {}, lambda e: None,
                     wandb_module=fake_wandb(run))
    sink(_step(loss_ce=2.25, loss_tv=0.5, loss_conf=0.125))
    sink(_step())
    sink(_eval())
    step, plain, ev = (data for _, data in run.logged)
    assert (step["train/loss_ce"], step["train/loss_tv"], step["train/loss_conf"]) == (
        2.25, 0.5, 0.125)
    assert not any(k.startswith("train/loss_") for k in plain)  # not logged as -1
    for key, value in calibration_wandb(calibrate(CONF, ACCEPTED)).items():
        assert ev[key] == value
    assert "eval/ece" in ev and "eval/tau_budget/2/adaptive" in ev
