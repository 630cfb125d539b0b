"""One drafter replica (replica.py): its gradients in one flat buffer, and the batches the loader
prepares training as the replica's own; on the tiny random target of test_trainer.py."""

import copy

import torch

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
