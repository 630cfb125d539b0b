"""What a run does at its steps that keeps a long run from being lost: a NaN loss stops it with
the last good checkpoint kept, and a filling disk is warned about before a checkpoint cannot fit."""

import math
from collections import namedtuple

import torch

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.folders import latest_checkpoint
from dflash_core.checkpoint.layout import CHECKPOINTS
from dflash_core.checkpoint.checksums import Verified, verify
from dflash_core.models import objective
from dflash_core.checkpoint import checkpointer
from dflash_core.pipeline import evaluation
from dflash_core.observe.events import Checkpoint, Error, EvalResult, Log, StepMetrics

from ..engine_fixtures import assets, make_config, run_config  # noqa: F401 - assets is a fixture


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, assets,
                                                                    monkeypatch):
    calls = []
    original = objective.chunked_loss

    def poisoned(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(1)
        if len(calls) > 4:  # from the 5th micro-group on (step 5 with one group a step)
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(objective, "chunked_loss", poisoned)
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=8, data__eval_prompts=0,
                      checkpoint__every=2, drafter__micro_block_tokens=1 << 20)
    end, rec = run_config(cfg)
    assert end.status == "failed"
    assert [m.step for m in rec.of(StepMetrics)] == [1, 2, 3, 4]
    (err,) = [e for e in rec.of(Error) if e.fatal]
    assert err.error_kind == "data" and "the loss is nan at step 5" in err.message
    assert "samples (data indices):" in err.message and "last checkpoint stands" in err.hint
    assert [c.step for c in rec.of(Checkpoint)] == [2, 4]  # nothing saved after the NaN
    latest = ckpt.load_checkpoint(latest_checkpoint(cfg.run_dir))
    assert latest.step == 4
    assert all(torch.isfinite(t).all() for t in latest.drafter_state.values())


Usage = namedtuple("Usage", "total used free")


def test_a_checkpoint_that_cannot_fit_is_skipped_and_said_so(tmp_path, assets, monkeypatch):
    free = [10 * 2**30]
    monkeypatch.setattr(checkpointer.shutil, "disk_usage", lambda p: Usage(free[0] * 2, 0, free[0]))
    real_begin = ckpt.begin_save

    def begin(*args, **kwargs):
        path = real_begin(*args, **kwargs)
        free[0] = 1000  # the disk fills up after the first checkpoint
        return path

    monkeypatch.setattr(ckpt, "begin_save", begin)
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=6, data__eval_prompts=0,
                      checkpoint__every=2)
    end, rec = run_config(cfg)
    assert end.status == "finished"  # the run goes on; only the checkpoint is skipped
    assert [c.step for c in rec.of(Checkpoint)] == [2]
    warnings = [e.message for e in rec.of(Log) if e.level == "warning"]
    assert any("disk nearly full" in w for w in warnings)
    skipped = [w for w in warnings if "skipped" in w]
    assert [w.split(":")[0] for w in skipped] == [
        "periodic checkpoint at step 4 skipped", "periodic checkpoint at step 6 skipped",
        "final checkpoint at step 6 skipped"]
    assert ckpt.load_checkpoint(latest_checkpoint(cfg.run_dir)).step == 2
    assert math.isfinite(rec.of(StepMetrics)[-1].loss)


def test_exact_tau_far_below_teacher_forced_on_the_same_text_is_the_mismatch_warning(
        tmp_path, assets, monkeypatch):
    from dflash_core.eval.evaluate import EvalSummary

    # an evaluation that accepts nothing, as a wrong mask token or layer ids would give; the
    # teacher-forced taus are what they are made to be
    monkeypatch.setattr(evaluation, "evaluate_tau", lambda t, d, prompts, n, *a, **k: EvalSummary(
        tau=0.5, acceptance=[8], prompts=len(prompts), tokens=8,
        outputs=[[1, 2, 3, 4] for _ in prompts]))
    monkeypatch.setattr(evaluation, "teacher_forced_eval", lambda *a, **k: (2.0, 10))
    target, data = assets
    for warn_at, warned in ((1.4, True), (1.5, False)):
        cfg = make_config(tmp_path, target, data, run__name=f"gap-{warn_at}", run__max_steps=3,
                          eval__tau_gap_warn=warn_at, eval__agreement_warn=0.0)
        end, rec = run_config(cfg)
        assert end.status == "finished"
        (e,) = rec.of(EvalResult)
        assert (e.tau, e.tau_tf_target, e.tau_tf_heldout) == (0.5, 2.0, 2.0)
        assert e.tau_tf_train > 0 and e.agreement_positions > 0 and 0 <= e.agreement <= 1
        gaps = [x for x in rec.of(Log) if "training and decoding disagree" in x.message]
        assert bool(gaps) == warned and ("mismatch" in e.findings) == warned
        if warned:
            assert gaps[0].level == "warning" and "drafter.mask_token_id" in gaps[0].message


def test_the_evaluation_decodes_uncompiled_and_training_keeps_its_attention(tmp_path, assets,
                                                                          monkeypatch):
    # Compiled FlexAttention at the evaluation's shapes (one block after a growing context)
    # compiled again at every evaluation and once found no kernel on an H200
    # (NoValidChoicesError); the evaluation uses the uncompiled attention, training its own.
    from dflash_core.models.dflash.drafter import DFlashDrafter

    real = evaluation.evaluate_tau
    seen_in_eval, seen_in_training = [], set()

    def evaluate(target_fn, drafter, *args, **kwargs):
        seen_in_eval.append((drafter.attn_impl, drafter.training))
        return real(target_fn, drafter, *args, **kwargs)

    forward = DFlashDrafter.forward

    def training_forward(self, *args, **kwargs):
        if self.training:
            seen_in_training.add(self.attn_impl)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate_tau", evaluate)
    monkeypatch.setattr(DFlashDrafter, "forward", training_forward)
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=4, eval__every=2)
    end, rec = run_config(cfg)
    assert end.status == "finished"
    evals = rec.of(EvalResult)
    assert [e.step for e in evals] == [2, 4] and all(e.tau >= 1.0 for e in evals)
    assert seen_in_eval == [("chunked", False)] * 2
    assert seen_in_training == {"auto"}  # training keeps its compiled attention (on a GPU)
    assert not [x for x in rec.of(Log) if "compiled attention" in x.message]
    assert not [e for e in rec.of(Error) if e.fatal]


def test_an_evaluation_that_fails_for_another_reason_is_not_retried(tmp_path, assets,
                                                                    monkeypatch):
    calls = []

    def evaluate(*args, **kwargs):
        calls.append(1)
        raise ValueError("a bug in the evaluation")

    monkeypatch.setattr(evaluation, "evaluate_tau", evaluate)
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=2, eval__every=2)
    end, rec = run_config(cfg)
    assert end.status == "failed" and len(calls) == 1
    assert any("a bug in the evaluation" in e.message for e in rec.of(Error) if e.fatal)


def test_with_eval_cache_the_runs_evaluation_decodes_with_the_cache_and_gets_the_same_figures(
        tmp_path, assets, monkeypatch):
    from dflash_core.eval.evaluate import target_fn_for

    real, compared = evaluation.evaluate_tau, []

    def evaluate(target_fn, drafter, *args, **kwargs):
        cached = real(target_fn, drafter, *args, **kwargs)
        full = real(target_fn_for(target_fn.model, target_fn.layer_ids), drafter, *args, **kwargs)
        compared.append((target_fn.cache, cached.outputs == full.outputs, cached.tau, full.tau))
        return cached

    monkeypatch.setattr(evaluation, "evaluate_tau", evaluate)
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=2, eval__every=2, eval__cache=True)
    end, rec = run_config(cfg)
    assert end.status == "finished"
    (uses_cache, same_text, tau_cached, tau_full), = compared
    assert uses_cache and same_text and tau_cached == tau_full
    assert [e.tau for e in rec.of(EvalResult)] == [tau_cached]


def test_a_damaged_folder_in_the_way_of_a_checkpoint_is_set_aside_and_said_so(tmp_path, assets,
                                                                               monkeypatch):
    # A step-4 folder that is not a whole checkpoint (a user's copy gone wrong, a disk fault)
    # lies where the run's step-4 checkpoint goes: it is kept as damaged-step-4, never replaced.
    real_begin = ckpt.begin_save

    def begin(run_dir, job):
        if job.step == 4:
            stray = run_dir / CHECKPOINTS / "step-4"
            stray.mkdir()
            (stray / "config.json").write_text("{}")
        return real_begin(run_dir, job)

    monkeypatch.setattr(ckpt, "begin_save", begin)
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=4, data__eval_prompts=0,
                      checkpoint__every=2)
    end, rec = run_config(cfg)
    assert end.status == "finished"
    root = cfg.run_dir / CHECKPOINTS
    (said,) = [e for e in rec.of(Log) if e.level == "warning" and "damaged" in e.message]
    assert said.source == "checkpoint"
    assert f"checkpoint {root / 'step-4'} is damaged (" in said.message
    assert "model.safetensors is missing" in said.message
    assert f"moved it to {root / 'damaged-step-4'} (kept, not deleted) before writing step 4 " \
        "again" in said.message
    assert (root / "damaged-step-4" / "config.json").read_text() == "{}"
    assert verify(root / "step-4") == Verified(4, [], "")
    assert [c.step for c in rec.of(Checkpoint)] == [2, 4]
