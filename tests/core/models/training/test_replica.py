"""One drafter replica (replica.py): its gradients in one flat buffer, and the batches the loader
prepares training as the replica's own; on the tiny random target of test_trainer.py."""

import copy

import pytest
import torch

from dflash_core.models import objective as obj
from dflash_core.models.training.replica import prepare_batch
from dflash_core.models.training.trainer import make_replicas, reduce_and_step

from ...engine_fixtures import assets  # noqa: F401 - a fixture
from .test_trainer import _setup, head_copies


def test_gradients_accumulate_into_the_flat_buffer_one_reduction_sums(tmp_path, assets):
    cfg, tm, batches, feats, init = _setup(tmp_path, assets)
    (rep,) = make_replicas(init, [torch.device("cpu")], cfg.drafter, cfg.optim, *head_copies(tm))
    rep.accumulate(batches[0], feats[0], cfg.run.seed)
    lo, hi = rep.flat.data_ptr(), rep.flat.data_ptr() + rep.grad_numel * 4
    for p in rep.params():
        assert lo <= p.grad.data_ptr() < hi, "a gradient left the flat buffer: not reduced"
    assert rep.grads.abs().sum() > 0
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in rep.params()]), rep.grads)


def test_loader_made_anchors_and_labels_train_like_the_drafters_own(tmp_path, assets):
    # The loader thread prepares each batch's anchors and labels; the step must be the same as
    # when the drafter makes them itself (an older or foreign batch).
    cfg, tm, batches, feats, init = _setup(tmp_path, assets, 1)
    cpu = torch.device("cpu")
    prepared = prepare_batch(batches[0], cfg.drafter.num_anchors, 4, cfg.run.seed)
    assert prepared.labels.shape[:2] == prepared.anchors.shape and prepared.labels.shape[2] == 4
    results = []
    for batch in (batches[0], prepared):
        (rep,) = make_replicas(copy.deepcopy(init), [cpu], cfg.drafter, cfg.optim, *head_copies(tm))
        rep.accumulate(batch, feats[0], cfg.run.seed)
        results.append((reduce_and_step([rep], 0, 10), rep.drafter.state_dict()))
    (a, wa), (b, wb) = results
    assert a.loss == b.loss and a.grad_norm == b.grad_norm and a.tau_tf == b.tau_tf
    for k in wa:
        assert torch.equal(wa[k], wb[k])


def _step(init, cfg, tm, batch, feats, **drafter):
    """One optimizer step of a fresh replica on ``batch`` with drafter keys changed."""
    d = copy.deepcopy(cfg.drafter)
    for k, v in drafter.items():
        setattr(d, k, v)
    (rep,) = make_replicas(copy.deepcopy(init), [torch.device("cpu")], d, cfg.optim,
                           *head_copies(tm))
    forwards = []
    real = rep.drafter.forward
    rep.drafter.forward = lambda *a, **k: forwards.append(a[3].shape) or real(*a, **k)
    rep.accumulate(batch, feats, cfg.run.seed)
    grads = rep.grads.clone()
    return reduce_and_step([rep], 0, 10), grads, forwards


def test_a_sequence_in_several_passes_of_fewer_anchors_steps_as_in_one(tmp_path, assets):
    """micro_block_tokens below one sequence's blocks: its anchors go in passes over the same
    context, and the step is the one pass's (every block is its own term of the loss)."""
    cfg, tm, batches, feats, init = _setup(tmp_path, assets, 1)
    batch = prepare_batch(batches[0], cfg.drafter.num_anchors, 4, cfg.run.seed)
    n, A = batch.anchors.shape
    assert A == 8 and n >= 2
    whole, g_whole, f_whole = _step(init, cfg, tm, batch, feats[0], micro_block_tokens=A * 4)
    split, g_split, f_split = _step(init, cfg, tm, batch, feats[0], micro_block_tokens=3 * 4)
    assert [s for s in f_whole] == [(1, 8)] * n  # one pass per sequence
    assert f_split[:3] == [(1, 3), (1, 3), (1, 2)]  # 3 + 3 + 2 anchors of the first
    assert len(f_split) == 3 * n
    assert split.loss == pytest.approx(whole.loss, rel=1e-5)
    assert split.tau_tf == whole.tau_tf and split.grad_norm == pytest.approx(whole.grad_norm,
                                                                             rel=1e-5)
    # as a whole: the passes sum float32 terms in another order (on one CPU, 2 elements of 11k
    # moved by 7e-7, past an element-wise 1e-5; the same code passed element-wise on another)
    assert (g_split - g_whole).norm() <= 1e-5 * g_whole.norm()
    assert (split.tokens, split.samples) == (whole.tokens, whole.samples)


def test_recompute_on_steps_as_off(tmp_path, assets):
    cfg, tm, batches, feats, init = _setup(tmp_path, assets, 1)
    off, g_off, _ = _step(init, cfg, tm, batches[0], feats[0], recompute="off")
    on, g_on, _ = _step(init, cfg, tm, batches[0], feats[0], recompute="on")
    assert on.loss == off.loss and torch.equal(g_on, g_off)


def test_density_anchors_follow_each_samples_length(tmp_path, assets):
    cfg, tm, batches, feats, init = _setup(tmp_path, assets, 1)
    b = batches[0]
    lengths = [int(x) for x in b.lengths]
    assert len(set(lengths)) > 1, "the fixture batch should hold samples of several lengths"
    dense = prepare_batch(b, 10_000, 4, cfg.run.seed, per_1k=250)
    counts = [int((row >= 0).sum()) for row in dense.anchors]
    valid = [len(obj.valid_anchor_positions(b.loss_mask[r, :lengths[r]].numpy()))
             for r in range(len(b))]
    assert counts == [max(1, -(-v * 250 // 1000)) if v else 0 for v in valid]
    # the replica draws the same when it makes them itself
    d = copy.deepcopy(cfg.drafter)
    d.num_anchors, d.anchors_per_1k_tokens = 10_000, 250.0
    (rep,) = make_replicas(copy.deepcopy(init), [torch.device("cpu")], d, cfg.optim,
                           *head_copies(tm))
    out = rep.accumulate(b, feats[0], cfg.run.seed)
    assert out.blocks == sum(1 for row in dense.labels for blk in row if blk[1] != obj.IGNORE)


def test_back_off_halves_the_sequences_then_the_anchors_then_recomputes(tmp_path, assets):
    cfg, tm, batches, feats, init = _setup(tmp_path, assets, 1)
    d = copy.deepcopy(cfg.drafter)
    d.micro_block_tokens = 4 * 8 * 4  # 4 sequences of 8 anchors x block 4
    (rep,) = make_replicas(copy.deepcopy(init), [torch.device("cpu")], d, cfg.optim,
                           *head_copies(tm))
    rep.accumulate(batches[0], feats[0], cfg.run.seed)
    said = []
    while (change := rep.back_off()) is not None:
        said.append(change)
    assert said[:2] == ["micro_block_tokens 128, now 64", "micro_block_tokens 64, now 32"]
    assert said[2:5] == ["micro_block_tokens 32, now 16 (4 anchors a pass)",
                         "micro_block_tokens 16, now 8 (2 anchors a pass)",
                         "micro_block_tokens 8, now 4 (1 anchor a pass)"]
    assert said[5].startswith("micro_block_tokens 4 (its smallest pass), now with the drafter's "
                              "layers recomputed")
    assert len(said) == 6 and rep.drafter.recompute
    # "off" never turns it on
    d.recompute = "off"
    (rep,) = make_replicas(copy.deepcopy(init), [torch.device("cpu")], d, cfg.optim,
                           *head_copies(tm))
    rep.accumulate(batches[0], feats[0], cfg.run.seed)
    while rep.back_off() is not None:
        pass
    assert not rep.drafter.recompute
