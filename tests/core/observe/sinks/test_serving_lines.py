"""Serving's counts (issue 46) in the records: train.log's eval line, W&B's keys and the report's
acceptance rows carry them beside tau, named as vLLM and SGLang name them; an older
events.jsonl (without them) replays with its lines and keys as they were."""

from __future__ import annotations

import pytest

from dflash_core.config import WandbConfig
from dflash_core.acceptance import report_rows, serving_fields
from dflash_core.observe.events import EvalResult, from_json
from dflash_core.observe.sinks.textlog import format_event
from dflash_core.observe.sinks.wandb_sink import WandbSink
from tests.core.observe.sinks.test_dspark_lines import FakeRun, fake_wandb

HIST, PROPOSED = [1, 1, 2, 1], [0, 1, 1, 3]  # 5 rounds (test_serving's known histogram)
NEW = EvalResult(step=40, tau=2.6, acceptance=HIST, prompts=8, seconds=5.0,
                 **serving_fields(HIST, PROPOSED), drafter_dtype="bfloat16")
GSM8K = EvalResult(step=40, tau=2.6, acceptance=HIST, prompts=16, prompt_set="gsm8k",
                   **serving_fields(HIST, PROPOSED), drafter_dtype="bfloat16")
OLD = EvalResult(step=40, tau=2.6, acceptance=HIST, prompts=8, seconds=5.0)


def test_the_event_carries_them_and_replays():
    assert NEW.accept_length_without_bonus == pytest.approx(1.6)
    assert NEW.acceptance_rate_per_position == pytest.approx([0.8, 0.75, 1 / 3])
    assert NEW.draft_acceptance_rate == pytest.approx(8 / 12)
    assert from_json(NEW.to_json()) == NEW
    old = '{"ts":1.0,"step":3,"tau":2.5,"acceptance":[1,1],"prompts":2,"event":"EvalResult"}'
    ev = from_json(old)
    assert ev.proposed == [] and ev.accept_length_without_bonus == -1.0
    assert ev.drafter_dtype == ""


def test_train_log_carries_them_and_the_dtype():
    line = format_event(NEW)
    assert ("accepted/round 0:1 1:1 2:2 3:1; accept length w/o bonus 1.60 | per-position "
            "acceptance rate 0.80 0.75 0.33 | draft acceptance rate 0.67") in line
    assert line.endswith("; drafter in bfloat16")
    assert "w/o bonus" not in format_event(OLD)  # an older event's line as it was


def test_wandb_logs_them_under_their_names(tmp_path):
    run = FakeRun()
    sink = WandbSink(WandbConfig(enabled=True), tmp_path, "r", {}, lambda e: None,
                     wandb_module=fake_wandb(run))
    sink(NEW)
    sink(GSM8K)
    sink(OLD)
    (_, held), (_, gsm), (_, old) = run.logged
    assert held["eval/accept_length_without_bonus"] == pytest.approx(1.6)
    assert held["eval/draft_acceptance_rate"] == pytest.approx(8 / 12)
    assert [held[f"eval/acceptance_rate_per_position/{k}"] for k in (1, 2, 3)] == \
        pytest.approx([0.8, 0.75, 1 / 3])
    assert gsm["eval/gsm8k/accept_length_without_bonus"] == pytest.approx(1.6)
    assert gsm["eval/gsm8k/acceptance_rate_per_position/3"] == pytest.approx(1 / 3)
    assert not any("bonus" in k or "per_position" in k for k in old)


def test_the_report_rows_name_them():
    rows = {r[0]: r[1] for r in report_rows(NEW)}
    assert rows["accept length w/o bonus"] == "1.60"
    assert rows["per-position acceptance rate"] == "0.80 0.75 0.33"
    assert rows["draft acceptance rate"] == "0.67"
    assert "accept length w/o bonus" not in {r[0] for r in report_rows(OLD)}
