"""Tau by context length (context_buckets.py) in the records: train.log's eval line ends with it
and W&B has a key per bucket (a set's under its name) when more than one bucket has rounds; with
one, or in an older event, the line and keys are as they were; the event round-trips."""

from __future__ import annotations

import dataclasses

from dflash_core.config import WandbConfig
from dflash_core.context_buckets import Buckets, by_context
from dflash_core.observe.events import EvalResult, from_json
from dflash_core.observe.sinks.textlog import format_event
from dflash_core.observe.sinks.wandb_sink import WandbSink
from tests.core.observe.sinks.test_dspark_lines import FakeRun, fake_wandb

B = Buckets.of(40960)
TWO = by_context(B, [([300, 600], [2, 1]), ([2000], [0])])  # 0-1k 2.50 (2), 1-4k 1.00 (1)
ONE = by_context(B, [([300, 600], [2, 1])])
HELD_OUT = EvalResult(step=40, tau=2.0, acceptance=[1, 1, 1], prompts=2, seconds=5.0,
                      context=TWO)
LONG = EvalResult(step=40, tau=2.0, acceptance=[1, 1, 1], prompts=2, prompt_set="long",
                  context=TWO)


def test_train_log_ends_the_eval_line_with_tau_by_context():
    assert format_event(HELD_OUT).endswith(
        "; tau by context 0-1k 2.50 (2) | 1-4k 1.00 (1)")
    assert format_event(LONG).startswith("eval step 40 on set long, 2 prompts")
    assert "tau by context 0-1k 2.50 (2) | 1-4k 1.00 (1)" in format_event(LONG)
    for quiet in (dataclasses.replace(HELD_OUT, context=ONE),
                  dataclasses.replace(HELD_OUT, context=[])):
        assert "by context" not in format_event(quiet)


def test_wandb_logs_a_key_per_bucket_with_rounds(tmp_path):
    run = FakeRun()
    sink = WandbSink(WandbConfig(enabled=True), tmp_path, "r", {}, lambda e: None,
                     wandb_module=fake_wandb(run))
    sink(HELD_OUT)
    sink(LONG)
    sink(dataclasses.replace(HELD_OUT, context=[], step=41))
    (_, held), (_, long), (_, old) = run.logged
    assert {k: v for k, v in held.items() if "context" in k} == {
        "eval/tau_by_context/0-1k": 2.5, "eval/rounds_by_context/0-1k": 2,
        "eval/tau_by_context/1-4k": 1.0, "eval/rounds_by_context/1-4k": 1}
    assert long["eval/long/tau_by_context/0-1k"] == 2.5 and long["eval/long/tau"] == 2.0
    assert not any("context" in k for k in old)


def test_an_evaluation_with_its_buckets_round_trips_through_events_jsonl():
    assert from_json(HELD_OUT.to_json()) == HELD_OUT
    old = '{"ts":1.0,"step":3,"tau":2.5,"acceptance":[1,1],"prompts":2,"event":"EvalResult"}'
    assert from_json(old).context == []
