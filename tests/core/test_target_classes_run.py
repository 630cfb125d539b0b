"""Targets beyond dense ones trained end to end through the engine on the CPU, one tiny
random-weight model of each class (models/target_classes.py): the mixtures of experts, gpt-oss
(whose sdpa preflight turns into eager) and the Gemma 3 multimodal wrapper. Random weights: the runs must finish with finite losses and
the plan and the log must say what the target is, not learn anything."""

from __future__ import annotations

import math

import pytest

from dflash_core.observe.events import Log, MemoryPlan, StepMetrics

from .engine_fixtures import (  # noqa: F401 - shutdown_started_engines: autouse fixture
    make_config, make_data, run_config, shutdown_started_engines,
)
from .models.target_classes import MOE, TINY, build


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
