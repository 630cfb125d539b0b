"""Features cross from the target's GPU to a drafter's without waiting on the target's next work,
and data-parallel replicas on two GPUs reduce with NCCL to the step one drafter would take."""

import copy

import pytest
import torch

from dflash_core.models.training.handoff import FeatureCopier, ready_event

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@two_gpus
def test_copy_does_not_queue_behind_the_targets_next_forward():
    src, dst = torch.device("cuda", 0), torch.device("cuda", 1)
    feats = torch.randn(64, 1024, 1024, device=src)  # 256 MiB: the "finished" features
    ready = ready_event(feats)
    a = torch.randn(8192, 8192, device=src)
    for _ in range(40):  # the target's next forward: a second or so of work on its stream
        a = a @ a / 8192**0.5
    pending = FeatureCopier(dst).start(feats, ready)
    pending._done.synchronize()  # the copy has finished ...
    assert not torch.cuda.current_stream(src).query(), "... while the target is still busy"
    got = pending.take()
    assert got.device == dst and torch.equal(got.cpu(), feats.cpu())


@two_gpus
def test_two_gpu_replicas_reduce_with_nccl_like_one_drafter(tmp_path):
    from torch.cuda import nccl

    from dflash_core.models.training.trainer import make_replicas, reduce_and_step
    from tests.core.engine_fixtures import make_config, make_data, make_target
    from tests.core.models.training.test_trainer import drafter_setup, head_copies

    target = make_target(tmp_path / "target", head_dim=16)
    data = make_data(tmp_path / "data")
    cfg = make_config(tmp_path, target, data, layout__device="cuda")
    g0, g1 = torch.device("cuda", 0), torch.device("cuda", 1)
    tm, batches, feats, init = drafter_setup(cfg, target, data, 2, g0)
    pair = make_replicas(copy.deepcopy(init), [g0, g1], cfg.drafter, cfg.optim, *head_copies(tm))
    assert nccl.is_available([r.flat for r in pair])
    for rep, b, f in zip(pair, batches, feats):
        rep.accumulate(b, f, cfg.run.seed, ready=ready_event(f))
    res_pair = reduce_and_step(pair, 0, 10)
    (single,) = make_replicas(copy.deepcopy(init), [g0], cfg.drafter, cfg.optim, *head_copies(tm))
    for b, f in zip(batches, feats):
        single.accumulate(b, f, cfg.run.seed)
    res_single = reduce_and_step([single], 0, 10)
    assert res_pair.loss == pytest.approx(res_single.loss, rel=1e-4)
    assert res_pair.grad_norm == pytest.approx(res_single.grad_norm, rel=1e-3)
    for p, q, s in zip(pair[0].params(), pair[1].params(), single.params()):
        assert torch.equal(p.cpu(), q.cpu())  # the replicas stay identical
        torch.testing.assert_close(p, s, rtol=1e-4, atol=1e-5)
