"""drafter.objective dspark through the engine on the CPU: the target sends its post-norm last
hidden state with the layer features, the drafter trains DSpark's loss and reports its three
terms, the evaluation drafts by chain and calibrates the confidence head, checkpoints are the
served folder and resume; a DSpark checkpoint resumed as DFlash is refused (exit 2)."""

import math

import pytest
import torch
from safetensors.torch import load_file

from dflash_core.models.dspark import format as dspark_format
from dflash_core.models.dspark.drafter import DSparkDrafter
from dflash_core.models.dspark.calibration import Calibration
from dflash_core.models.training.replica import DrafterReplica
from dflash_core.observe.events import Checkpoint, Error, EvalResult, RunEnded, StepMetrics
from dflash_core.pipeline.engine import Engine
from dflash_core.checkpoint import save_load as ckpt

from ..engine_fixtures import assets, make_config, run_to_end, write_config  # noqa: F401
from .test_headless import Headless

HIDDEN, FEATURES = 32, 2  # the tiny target's width; make_config's target.num_features


def dspark_config(tmp_path, assets, **over):
    target, data = assets
    return make_config(tmp_path, target, data, drafter__objective="dspark",
                       drafter__markov_rank=16, **over)


def test_trains_evaluates_checkpoints_and_resumes(tmp_path, assets, monkeypatch):
    widths = []
    original = DrafterReplica.accumulate

    def accumulate(self, batch, features, seed, **kwargs):
        widths.append((features.shape[-1], batch.labels.shape[-1]))
        return original(self, batch, features, seed, **kwargs)

    monkeypatch.setattr(DrafterReplica, "accumulate", accumulate)
    cfg = dspark_config(tmp_path, assets, run__max_steps=4, checkpoint__every=2)
    assert (cfg.drafter.block_size, cfg.drafter.loss_chunk) == (4, 64)  # as the config set
    first = Engine(cfg)
    first.bus.tap(lambda ev: first.abort() if isinstance(ev, StepMetrics) and ev.step == 2
                  else None)
    rec = run_to_end(first)
    first.shutdown()
    assert rec.of(RunEnded)[-1].status == "aborted"
    # k layer features and the post-norm last hidden state; labels one slot wider than B
    assert set(widths) == {((FEATURES + 1) * HIDDEN, 5)}
    for m in rec.of(StepMetrics):
        assert min(m.loss_ce, m.loss_tv, m.loss_conf) > 0 and m.loss_tv <= 2
        assert m.loss == pytest.approx(0.1 * m.loss_ce + 0.9 * m.loss_tv + m.loss_conf,
                                       rel=1e-4)
        assert 1 <= m.tau_tf <= 5

    second = Engine(cfg, resume=True)
    rec = run_to_end(second)
    second.shutdown()
    assert rec.of(RunEnded)[-1].status == "finished"
    assert [m.step for m in rec.of(StepMetrics)] == [3, 4]
    (ev,) = rec.of(EvalResult)
    assert len(ev.acceptance) == 5 and math.isfinite(ev.tau) and ev.tau <= 5  # B drafts: B+1
    cal = Calibration.from_dict(ev.calibration)
    assert cal is not None and cal.rounds == sum(ev.acceptance)  # every round of the prompts
    assert [b.drafts for b in cal.budgets] == [2, 4] and 0 <= cal.ece <= 1
    log = (cfg.run_dir / "train.log").read_text()
    assert "(ce " in log and "| ECE " in log and "tau@2 " in log

    folder = cfg.run_dir / "checkpoints" / "step-4"
    assert {(c.step, c.reason) for c in rec.of(Checkpoint)} >= {(4, "periodic")}
    served = load_file(str(folder / "model.safetensors"))
    assert set(dspark_format.FROZEN_KEYS) <= set(served)
    assert all(t.dtype == torch.bfloat16 for t in served.values())
    back = DSparkDrafter.load(folder)
    assert (back.block_size, back.markov_rank) == (4, 16)
    loaded = ckpt.load_checkpoint(folder)
    assert not set(dspark_format.FROZEN_KEYS) & set(loaded.drafter_state)
    # what the run counted for a checkpoint is what the folder holds (the JSON aside)
    size = sum(p.stat().st_size for p in folder.rglob("*.safetensors"))
    (said,) = [c.bytes for c in rec.of(Checkpoint) if c.step == 4 and c.bytes]
    assert said <= size < said + 64 * 1024


@pytest.mark.slow  # fast path: tests/core/checkpoint/test_dspark_checkpoint.py (the same refusal)
def test_a_dspark_checkpoint_resumed_as_dflash_is_refused_with_exit_2(tmp_path, assets):
    cfg = dspark_config(tmp_path, assets, run__max_steps=2, checkpoint__every=2,
                       data__eval_prompts=0)
    rec = run_to_end(Engine(cfg))
    assert rec.of(RunEnded)[-1].status == "finished"
    cfg.drafter.objective = "dflash"
    path = write_config(tmp_path / "config.yaml", cfg)
    rc, out, err = Headless(path, "--resume").finish()
    assert rc == 2, out + err
    line = next(x for x in out.splitlines() if x.startswith("ERROR [config]"))
    assert "drafter.objective: the checkpoint" in line
    assert line.endswith("holds a DSpark drafter, but drafter.objective is dflash")
    assert "hint: set drafter.objective: dspark to resume it" in out
    assert "Traceback" not in out + err
    # nothing was loaded or written after the refusal
    assert [p.name for p in (cfg.run_dir / "checkpoints").iterdir()
            if p.name.startswith("step-")] == ["step-2"]


def test_dpace_with_dspark_never_starts(tmp_path, assets):
    target, data = assets
    from dflash_core.config import ConfigError

    with pytest.raises(ConfigError, match="dpace does not combine"):
        make_config(tmp_path, target, data, drafter__objective="dspark", drafter__loss="dpace")
