"""A drafter step that runs out of memory backs off to a smaller micro-group and trains the same
batches again: the run goes on as if it had used the smaller size from the start."""

import pytest
import torch

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.folders import latest_checkpoint
from dflash_core.models.dflash.drafter import DFlashDrafter
from dflash_core.observe.events import Error, Log, StepMetrics

from ..engine_fixtures import assets, make_config, run_config  # noqa: F401 - fixture

# 8 anchors x block 4 = 32 block tokens per sequence: 128 puts 4 sequences in a micro-group
# (every batch of the fixture data), 64 puts 2.
PER_SEQ = 32


def run(tmp_path, assets, name: str, micro: int):
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__name=name, run__max_steps=6,
                      drafter__micro_block_tokens=micro, data__eval_prompts=0,
                      checkpoint__every=0)
    end, rec = run_config(cfg)
    weights = ckpt.load_checkpoint(latest_checkpoint(cfg.run_dir)).drafter_state
    return end, rec, weights


def oom_above(monkeypatch, max_rows: int, calls: list):
    """The drafter's forward runs out of memory whenever a micro-group holds more than
    ``max_rows`` sequences (as a card too small for the configured size would)."""
    original = DFlashDrafter.forward

    def forward(self, context, *args, **kwargs):
        calls.append(context.shape[0])
        if context.shape[0] > max_rows:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.79 GiB")
        return original(self, context, *args, **kwargs)

    monkeypatch.setattr(DFlashDrafter, "forward", forward)


def test_oom_in_a_drafter_step_backs_off_and_matches_the_smaller_size(tmp_path, assets,
                                                                     monkeypatch):
    calls: list[int] = []
    oom_above(monkeypatch, 2, calls)
    ref_end, ref, ref_w = run(tmp_path, assets, "small", 2 * PER_SEQ)
    assert ref_end.status == "finished" and max(calls) <= 2
    calls.clear()
    end, rec, w = run(tmp_path, assets, "backoff", 4 * PER_SEQ)

    assert end.status == "finished", [e.message for e in rec.of(Error)]
    assert not rec.of(Error)
    assert calls.count(4) == 1 and max(calls[1:]) <= 2  # one failure, then the smaller size
    (warn,) = [e for e in rec.of(Log) if "out of memory" in e.message]
    assert warn.level == "warning" and warn.source == "drafter-0"
    assert "micro_block_tokens 128, now 64, step 1 retried" in warn.message
    # No sample skipped or counted twice, and the same weights as the smaller size throughout.
    assert [m.samples for m in rec.of(StepMetrics)] == [m.samples for m in ref.of(StepMetrics)]
    assert [m.step for m in rec.of(StepMetrics)] == list(range(1, 7))
    for key in ref_w:
        assert torch.allclose(w[key], ref_w[key], atol=1e-5), key
    assert [m.loss for m in rec.of(StepMetrics)] == pytest.approx(
        [m.loss for m in ref.of(StepMetrics)], rel=1e-4)


def test_oom_with_one_sequence_per_group_still_fails_the_run_with_the_hint(tmp_path, assets,
                                                                           monkeypatch):
    calls: list[int] = []
    oom_above(monkeypatch, 0, calls)
    target, data = assets
    cfg = make_config(tmp_path, target, data, drafter__micro_block_tokens=4 * PER_SEQ,
                      data__eval_prompts=0)
    end, rec = run_config(cfg)
    assert end.status == "failed"
    assert sorted(set(calls)) == [1, 2, 4]  # backed off 4 -> 2 -> 1, then gave up
    (err,) = [e for e in rec.of(Error) if e.fatal]
    assert err.source == "drafter-0" and "drafter.micro_block_tokens" in err.hint
