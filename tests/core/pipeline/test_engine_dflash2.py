"""drafter.objective dflash2 through the engine on the CPU: the drafter trains DFlash's loss +
the selector's and reports both terms and the selector's hit rate, the evaluation decodes along
the selector's walk and beside it with the unary argmax, checkpoints are the served folder and
resume; a DFlash checkpoint starts a DFlash2 run (drafter.init_from)."""

import json
import math

import pytest
from safetensors import safe_open

from dflash_core.families.dflash2 import ARCHITECTURE
from dflash_core.models.dflash2.drafter import DFlash2Drafter
from dflash_core.observe.events import Checkpoint, EvalResult, RunEnded, StepMetrics
from dflash_core.pipeline.engine import Engine

from ..engine_fixtures import assets, make_config, run_to_end  # noqa: F401

ALPHA = 0.5


def dflash2_config(tmp_path, assets, **over):
    target, data = assets
    return make_config(tmp_path, target, data, drafter__objective="dflash2",
                       drafter__selector_rank=8, drafter__selector_top_k=4,
                       drafter__selector_alpha=ALPHA, **over)


def test_trains_evaluates_checkpoints_and_resumes(tmp_path, assets):
    cfg = dflash2_config(tmp_path, assets, run__max_steps=4, checkpoint__every=2)
    assert cfg.drafter.block_size == 4  # as the config set it
    first = Engine(cfg)
    first.bus.tap(lambda ev: first.abort() if isinstance(ev, StepMetrics) and ev.step == 2
                  else None)
    rec = run_to_end(first)
    first.shutdown()
    assert rec.of(RunEnded)[-1].status == "aborted"
    for m in rec.of(StepMetrics):
        assert m.loss_ce > 0 and m.loss_sel >= 0 and 0 <= m.loss_hit <= 1
        assert m.loss == pytest.approx(m.loss_ce + ALPHA * m.loss_sel, rel=1e-4)
        assert m.loss_tv == -1 and 1 <= m.tau_tf <= 4

    second = Engine(cfg, resume=True)
    rec = run_to_end(second)
    second.shutdown()
    assert rec.of(RunEnded)[-1].status == "finished"
    assert [m.step for m in rec.of(StepMetrics)] == [3, 4]
    (ev,) = rec.of(EvalResult)
    assert len(ev.acceptance) == 4 and math.isfinite(ev.tau) and 1 <= ev.tau <= 4
    assert 1 <= ev.tau_unary <= 4  # the unary argmax measured beside the selector's walk
    log = (cfg.run_dir / "train.log").read_text()
    assert " sel " in log and " hit " in log and "tau unary argmax" in log

    folder = cfg.run_dir / "checkpoints" / "step-4"
    assert {(c.step, c.reason) for c in rec.of(Checkpoint)} >= {(4, "periodic")}
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "candidate_selector.successor_codebook" in keys
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in keys)
    back = DFlash2Drafter.load(folder)
    assert (back.block_size, back.selector_top_k) == (4, 4)


def test_a_dflash_checkpoint_starts_a_dflash2_run_which_resumes(tmp_path, assets):
    target, data = assets
    flash = make_config(tmp_path, target, data, run__max_steps=2, run__name="flash",
                        checkpoint__every=2, data__eval_prompts=0)
    rec = run_to_end(Engine(flash))
    assert rec.of(RunEnded)[-1].status == "finished"
    start = flash.run_dir / "checkpoints" / "step-2"
    cfg = dflash2_config(tmp_path, assets, run__max_steps=2, run__name="two",
                         drafter__init_from=str(start), data__eval_prompts=0)
    rec = run_to_end(Engine(cfg))
    assert rec.of(RunEnded)[-1].status == "finished"
    config = json.loads((cfg.run_dir / "checkpoints" / "step-2" / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    # its resume compares the checkpoint with DFlash2's config of the DFlash folder
    cfg.run.max_steps = 3
    rec = run_to_end(Engine(cfg, resume=True))
    assert rec.of(RunEnded)[-1].status == "finished"
    assert [m.step for m in rec.of(StepMetrics)] == [3]
