"""Target groups on CUDA: features cross from a rank's process to the engine's by CUDA IPC (no
trip through host memory), equal to the same forward in the engine's process; a killed rank is
named; no rank outlives its group. Two GPUs: a 2-rank sharded group (FSDP + EP, NCCL)."""

import os
import signal
import time

import pytest
import torch

from dflash_core.models.target.load import load_target
from dflash_core.pipeline.group_stage import GroupStage  # noqa: F401 (the engine's side imports)

from tests.core.models.target.target_classes import VOCAB, build
from tests.core.target_group.group_harness import reply, start_group, wait_loaded

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def _has_ep_size() -> bool:
    import dataclasses
    from transformers.distributed import DistributedConfig
    return "ep_size" in {f.name for f in dataclasses.fields(DistributedConfig)}


def _batch(seed, rows=4, length=256):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    return ids, torch.ones_like(ids)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("group-gpu") / "qwen3_moe"
    build("qwen3_moe").save_pretrained(folder)
    return folder


def test_one_rank_hands_features_over_cuda_ipc(moe_folder, tmp_path):
    dev = torch.device("cuda", 0)
    one = load_target(moe_folder, device=dev, dtype="float32")
    group = start_group(moe_folder, "sharded", True, tmp_path, k=1, devices=[dev])
    try:
        wait_loaded(group)
        for seq in (1, 2, 3):
            ids, mask = _batch(seq)
            group.requests[0].put(("batch", seq, ids, mask))
            _, got_seq, feats = reply(group, 0, ("features",))
            assert got_seq == seq and feats.is_cuda and feats.device == dev  # IPC, not host
            want = one.features(ids, mask, [1, 2])
            assert float((feats - want).abs().max()) < 1e-4
            own = feats.clone()
            del feats
            group.requests[0].put(("ack", seq))
            assert own.is_cuda
        group.requests[0].put(("end",))
        reply(group, 0, ("done",))
    finally:
        assert group.shutdown() == []


def test_a_killed_rank_is_named_and_the_group_ends(moe_folder, tmp_path):
    group = start_group(moe_folder, "sharded", True, tmp_path, k=1,
                        devices=[torch.device("cuda", 0)])
    try:
        wait_loaded(group)
        os.kill(group.procs[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while group.dead_rank() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = group.dead_rank()
        assert dead is not None and "rank 0 (cuda:0" in str(dead) and "SIGKILL" in str(dead)
    finally:
        group.shutdown()
    assert not any(p.is_alive() for p in group.procs)


@two_gpus
@pytest.mark.skipif(not _has_ep_size(), reason="expert parallel needs transformers >= 5.21 "
                    "(ep_size); preflight refuses it on older ones")
def test_two_rank_sharded_group_on_two_gpus(moe_folder, tmp_path):
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    one = load_target(moe_folder, device=devs[0], dtype="float32")
    group = start_group(moe_folder, "sharded", True, tmp_path, devices=devs)
    try:
        wait_loaded(group)
        for r in range(2):
            group.requests[r].put(("batch", 1, *_batch(r, rows=2 + r)))
        for r in range(2):
            _, _, feats = reply(group, r, ("features",))
            assert feats.device == devs[r]
            ids, mask = _batch(r, rows=2 + r)
            want = one.features(ids, mask, [1, 2]).to(devs[r])
            assert float((feats - want).abs().max()) < 1e-3
            del feats
            group.requests[r].put(("ack", 1))
            group.requests[r].put(("end",))
        for r in range(2):
            reply(group, r, ("done",))
    finally:
        assert group.shutdown() == []
