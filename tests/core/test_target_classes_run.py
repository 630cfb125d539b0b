"""Targets beyond dense ones trained end to end through the engine on the CPU, one tiny
random-weight model of each class (models/target/target_classes.py): the mixtures of experts, gpt-oss
(whose sdpa preflight turns into eager), the Gemma 3 multimodal wrapper and an FP8 checkpoint.
Random weights: the runs must finish with finite losses and the plan and the log must say what
the target is, not learn anything."""

from __future__ import annotations

import json
import math

import pytest

from dflash_core.observe.events import Log, MemoryPlan, StepMetrics

from .engine_fixtures import (  # noqa: F401 - shutdown_started_engines: autouse fixture
    make_config, make_data, run_config, shutdown_started_engines,
)
from .models.target.target_classes import MOE, TINY, build
from .models.target.test_target_classes import remote_code_target  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data") / "data", n=32)


def _run(tmp_path, data, name: str, **over):
    folder = tmp_path / name
    build(name).save_pretrained(folder)
    cfg = make_config(tmp_path, folder, data, run__max_steps=3, checkpoint__every=0,
                      data__eval_prompts=1, eval__max_new_tokens=4, target__layer_ids=[1, 2],
                      **over)
    end, rec = run_config(cfg)
    return cfg, end, rec


@pytest.mark.parametrize("name", sorted(TINY))
def test_each_target_class_trains_through_the_engine(tmp_path, data, name):
    cfg, end, rec = _run(tmp_path, data, name)
    assert end.status == "finished", end.reason
    steps = rec.of(StepMetrics)
    assert [m.step for m in steps] == [1, 2, 3]
    assert all(math.isfinite(m.loss) and m.loss > 0 for m in steps)
    (plan,) = rec.of(MemoryPlan)
    row = plan.rows[0]["components"]
    # a mixture of experts has its routed experts in a row of their own
    assert (row.get("experts", 0) > 0) == (name in MOE) and row["weights"] > 0
    said = [e.message for e in rec.of(Log) if "attn_implementation" in e.message]
    if name == "gpt_oss":  # asked for sdpa (the default), got eager, and the log says why
        assert len(said) == 1 and "cannot run sdpa" in said[0] and "eager" in said[0]
    else:
        assert said == []


def test_an_fp8_checkpoint_trains_on_the_cpu_and_the_log_says_it_is_dequantized(tmp_path, data):
    from dflash_core.planning.weight_bytes import target_weight_bytes

    from .models.target.test_target_classes import fp8_checkpoint

    folder = tmp_path / "fp8"
    folder.mkdir()
    fp8_checkpoint(folder)
    cfg = make_config(tmp_path, folder, data, run__max_steps=2, checkpoint__every=0,
                      data__eval_prompts=0, target__layer_ids=[0, 1])
    end, rec = run_config(cfg)
    assert end.status == "finished", end.reason
    said = [e.message for e in rec.of(Log) if "FP8" in e.message]
    assert len(said) == 1 and "cannot run here" in said[0] and "float32" in said[0]
    assert [e.level for e in rec.of(Log) if "FP8" in e.message] == ["warning"]
    (plan,) = rec.of(MemoryPlan)
    row = plan.rows[0]["components"]
    hf_config = json.loads((folder / "config.json").read_text())
    assert row["weights"] + row["experts"] == target_weight_bytes(hf_config, "float32")


def test_a_trusted_remote_code_target_trains_through_the_engine(tmp_path, data,
                                                               remote_code_target):
    # target.trust_remote_code reaches every load (the target stage's too), never a prompt.
    cfg = make_config(tmp_path, remote_code_target, data, run__max_steps=2, checkpoint__every=0,
                      data__eval_prompts=0, target__layer_ids=[1, 2],
                      target__trust_remote_code=True)
    end, rec = run_config(cfg)
    assert end.status == "finished", end.reason
    assert all(math.isfinite(m.loss) for m in rec.of(StepMetrics))
