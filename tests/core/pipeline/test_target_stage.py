"""A target forward that runs out of memory is split into row groups and run again: the run goes
on, with the features (and so the training) it would have had without the error."""

import torch

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.folders import latest_checkpoint
from dflash_core.observe.events import Error, Log, StepMetrics
from dflash_core.models.target.model import TargetModel

from ..engine_fixtures import assets, make_config, run_config  # noqa: F401 - fixture


def run(tmp_path, assets, name: str, **over):
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__name=name, run__max_steps=4,
                      data__eval_prompts=0, checkpoint__every=0, **over)
    end, rec = run_config(cfg)
    weights = ckpt.load_checkpoint(latest_checkpoint(cfg.run_dir)).drafter_state
    return end, rec, weights


def test_oom_in_a_target_forward_splits_the_batch(tmp_path, assets, monkeypatch):
    ref_end, ref, ref_w = run(tmp_path, assets, "whole")
    rows: list[int] = []
    original = TargetModel.features

    def features(self, input_ids, *args, **kwargs):
        rows.append(len(input_ids))
        if len(input_ids) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 30.00 GiB")
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(TargetModel, "features", features)
    end, rec, w = run(tmp_path, assets, "split")
    assert ref_end.status == end.status == "finished", [e.message for e in rec.of(Error)]
    assert rows[0] == 4 and rows.count(4) == 1 and max(rows[1:]) <= 2  # split once, kept
    (warn,) = [e for e in rec.of(Log) if "out of memory" in e.message]
    assert warn.level == "warning" and warn.source == "target-0"
    assert "now split 2 ways" in warn.message
    assert [m.samples for m in rec.of(StepMetrics)] == [m.samples for m in ref.of(StepMetrics)]
    for key in ref_w:
        assert torch.allclose(w[key], ref_w[key], atol=1e-5), key


def test_oom_on_a_single_row_fails_the_run(tmp_path, assets, monkeypatch):
    def features(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 30.00 GiB")

    monkeypatch.setattr(TargetModel, "features", features)
    target, data = assets
    end, rec = run_config(make_config(tmp_path, target, data, data__eval_prompts=0))
    assert end.status == "failed"
    (err,) = [e for e in rec.of(Error) if e.fatal]
    assert err.source == "target-0" and "data.token_budget" in err.hint
