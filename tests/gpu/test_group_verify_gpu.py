"""Speculative decoding through a target group on CUDA: the verify answers cross from rank 0 by
CUDA IPC and land on the drafter's GPU; decoding through the group equals the same decoding in
the engine's process (fp32, an oracle drafter, full forwards and the cache), its output is the
group's own plain decoding; a rank killed while the engine waits on it is named. One GPU: a
group of one rank (the hand-off). Two GPUs: a 2-rank sharded group (FSDP + EP, NCCL), and the
run's evaluation through it equal to a one-GPU run's."""

import os
import signal

import pytest
import torch

from dflash_core.eval import spec_decode
from dflash_core.eval.drafters import load_weights, read_drafter
from dflash_core.eval.spec_decode import DecodeSettings, decode_rows
from dflash_core.eval.target_decoding import rows_backend
from dflash_core.models.target.load import load_target
from dflash_core.target_group.group import GroupRankFailed
from dflash_core.target_group.session import GroupSession
from dflash_core.target_group.split import GroupSplit

from tests.core.eval.conftest import save_dflash
from tests.core.eval.test_spec_decode import _truth, oracle
from tests.core.models.target.target_classes import VOCAB, build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

LAYERS = [1, 2]
NEW = 24
PROMPTS = [[5, 17, 3, 9], [1], list(range(10, 60))]


def _has_ep_size() -> bool:
    import dataclasses
    from transformers.distributed import DistributedConfig
    return "ep_size" in {f.name for f in dataclasses.fields(DistributedConfig)}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify-gpu")
    build("qwen3_moe").save_pretrained(root / "target")
    return root


def _decode_both(root, devices, mode, monkeypatch):
    dev = torch.device("cuda", 0)
    one = load_target(root / "target", device=dev, dtype="float32")
    spec = read_drafter(str(save_dflash(root / "drafter", one.model.config, 0, LAYERS, block=5,
                                        mask=VOCAB - 1)))
    drafter = load_weights(spec, one, dev)
    drafter.attn_impl = "chunked"
    truth = _truth(one, LAYERS, PROMPTS, NEW)
    session = GroupSession(root / "target", devices, GroupSplit(len(devices), mode, True),
                           dtype="float32", attn_implementation="sdpa", layer_ids=LAYERS,
                           trust_remote_code=False, folder=root / f"run-{len(devices)}",
                           say=lambda m: None)
    try:
        group = session.open(dev)
        logits, feats = group.forward_rows([PROMPTS[2]], [3], LAYERS, exact_head=True)
        assert logits.device == dev and feats.device == dev  # on the drafter's GPU, owned here
        for cache in (False, True):
            monkeypatch.setattr(spec_decode, "propose", oracle(truth))
            here = decode_rows(rows_backend(one, LAYERS, cache), drafter, PROMPTS,
                               DecodeSettings(NEW))
            monkeypatch.setattr(spec_decode, "propose", oracle(truth))
            there = decode_rows(rows_backend(group, LAYERS, cache), drafter, PROMPTS,
                                DecodeSettings(NEW))
            assert [r.tokens for r in there] == [r.tokens for r in here]
            assert [r.acceptance for r in there] == [r.acceptance for r in here]
            plain = decode_rows(rows_backend(group, LAYERS, cache), None, PROMPTS,
                                DecodeSettings(NEW))
            assert [r.tokens for r in plain] == [r.tokens for r in there]
        os.kill(session.group.procs[-1].pid, signal.SIGKILL)
        with pytest.raises(GroupRankFailed) as err:
            group.features(torch.tensor([PROMPTS[0]]), layer_ids=LAYERS)
        assert f"rank {len(devices) - 1} (cuda:{devices[-1].index}" in str(err.value)
    finally:
        session.close()
    assert not any(p.is_alive() for p in session.group.procs)


def test_one_rank_decodes_as_the_engine_s_process(moe, monkeypatch):
    _decode_both(moe, [torch.device("cuda", 0)], "sharded", monkeypatch)


@two_gpus
@pytest.mark.skipif(not _has_ep_size(), reason="expert parallel needs transformers >= 5.21 "
                                               "(DistributedConfig.ep_size)")
def test_two_ranks_sharded_decode_as_the_engine_s_process(moe, monkeypatch):
    _decode_both(moe, [torch.device("cuda", 0), torch.device("cuda", 1)], "sharded",
                 monkeypatch)


@two_gpus
def test_the_run_s_evaluation_through_a_group_on_two_gpus(tmp_path):
    """A run with a 2-rank group on GPUs 0-1 and its drafter on GPU 0 evaluates (mid-training
    and at the end) to a one-GPU run's figures."""
    from tests.core.engine_fixtures import make_data, make_target
    from tests.core.target_group.test_engine_group_eval import EVAL, evaluations
    from tests.core.engine_fixtures import make_config

    target, data = make_target(tmp_path / "target"), make_data(tmp_path / "data")
    gpu = dict(layout__device="cuda", target__dtype="float32")
    one = evaluations(make_config(tmp_path / "one", target, data, **gpu, **EVAL))
    got = evaluations(make_config(tmp_path / "group", target, data, **gpu, **EVAL,
                                  layout__targets=[0, 1], target__gpus_per_copy=2))
    assert [e.step for e in got] == [e.step for e in one]
    for g, o in zip(got, one):
        assert g.tau == pytest.approx(o.tau, abs=0.05)  # fp32 on GPUs: summation order only
        assert g.prompts == o.prompts
