"""A prompt set's evaluation (eval.prompt_sets) in the records: one train.log line per set naming
it, W&B keys under the set's name (eval/<set>/tau, eval/<set>/accepted_at_<k>), the held-out
evaluation's lines and keys as they were."""

from __future__ import annotations

from dflash_core.config import WandbConfig
from dflash_core.observe.events import Checkpoint, EvalResult, from_json
from dflash_core.observe.sinks.textlog import format_event
from dflash_core.observe.sinks.wandb_sink import WandbSink
from tests.core.observe.sinks.test_dspark_lines import FakeRun, fake_wandb

HELD_OUT = EvalResult(step=40, tau=3.21, acceptance=[1, 2, 1], prompts=8, seconds=5.0,
                      tau_tf_target=3.4, tau_tf_heldout=3.3, tau_tf_train=4.0)
GSM8K = EvalResult(step=40, tau=2.5, acceptance=[2, 1, 1], prompts=16, seconds=83.4,
                   prompt_set="gsm8k")


def test_train_log_writes_a_line_per_set_naming_it():
    line = format_event(GSM8K)
    assert line == ("eval step 40 on set gsm8k, 16 prompts in 1m23s: tau exact 2.50 | "
                    "accepted@k 50% 25%; accepted/round 0:2 1:1 2:1")
    held = format_event(HELD_OUT)  # unchanged: every measure, no set named
    assert held.startswith("eval step 40 on 8 prompts in 5.0 s: tau exact 3.21 | tf target 3.40")
    assert "set" not in held


def test_train_log_says_which_tau_made_a_checkpoint_the_best():
    best = dict(step=40, path="runs/r/checkpoints/step-40", seconds=0.0, reason="best", tau=2.5)
    assert format_event(Checkpoint(**best, prompt_set="gsm8k")) == (
        "checkpoint step 40 (best, exact tau 2.50 on set gsm8k) in 0.0 s: "
        "runs/r/checkpoints/step-40")
    assert "(best, exact tau 2.50) in" in format_event(Checkpoint(**best))
    assert "(periodic) in" in format_event(Checkpoint(step=40, path="p", seconds=1.0))


def test_wandb_logs_each_set_under_its_name(tmp_path):
    run = FakeRun()
    sink = WandbSink(WandbConfig(enabled=True), tmp_path, "r", {}, lambda e: None,
                     wandb_module=fake_wandb(run))
    sink(HELD_OUT)
    sink(GSM8K)
    (s1, held), (s2, gsm) = run.logged
    assert s1 == s2 == 40
    assert gsm == {"eval/gsm8k/prompts": 16, "eval/gsm8k/tau": 2.5,
                   "eval/gsm8k/accepted_at_1": 0.5, "eval/gsm8k/accepted_at_2": 0.25}
    assert held["eval/tau"] == 3.21 and held["eval/accepted_at_1"] == 0.75
    assert not any("gsm8k" in k for k in held)


def test_a_sets_result_round_trips_through_events_jsonl():
    assert from_json(GSM8K.to_json()) == GSM8K
    old = '{"ts":1.0,"step":3,"tau":2.5,"acceptance":[1,1],"prompts":2,"event":"EvalResult"}'
    assert from_json(old).prompt_set == ""
