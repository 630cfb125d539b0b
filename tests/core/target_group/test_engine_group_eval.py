"""The run's evaluation with a target group: the held-out measures (exact tau, the teacher-
forced ones, the agreement) decoded through the group's ranks equal a one-GPU run's of the same
weights and data, at a periodic evaluation in the middle of training (the ranks' batch streams
running) and at the end (after them)."""

import pytest

from dflash_core.observe.events import Error, EvalResult, Log
from dflash_core.pipeline.engine import Engine

from ..engine_fixtures import Recorder, assets, make_config  # noqa: F401 - assets: a fixture

GROUP = dict(layout__targets=[0, 1], target__gpus_per_copy=2)
EVAL = dict(eval__every=3, eval__agreement_samples=4)


def evaluations(cfg) -> list[EvalResult]:
    engine = Engine(cfg)
    rec = Recorder(engine.bus)
    engine.start()
    ended = rec.wait_ended(180)
    engine.shutdown()
    assert ended.status == "finished", [e.message for e in rec.of(Error)]
    assert not [e for e in rec.of(Log) if "no evaluation in the run" in e.message]
    return rec.of(EvalResult)


@pytest.mark.parametrize("mode", ["sharded", pytest.param("shared", marks=pytest.mark.slow)])
def test_the_run_s_evaluation_through_a_group_is_a_one_gpu_run_s(assets, tmp_path, mode):
    target, data = assets
    one = evaluations(make_config(tmp_path / "one", target, data, **EVAL))
    got = evaluations(make_config(tmp_path / "group", target, data, target__parallel=mode,
                                  **EVAL, **GROUP))
    assert [e.step for e in got] == [e.step for e in one] == [3, 6]
    for g, o in zip(got, one):
        assert g.acceptance == o.acceptance and g.prompts == o.prompts == 2
        # fp32: the group's forwards differ from one process's by summation order only
        for name in ("tau", "tau_tf_target", "tau_tf_target_all", "tau_tf_heldout",
                     "agreement"):
            assert getattr(g, name) == pytest.approx(getattr(o, name), abs=1e-6), name
    assert got[0].agreement_positions == one[0].agreement_positions > 0
