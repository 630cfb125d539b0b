"""Drafter replicas and their optimizer step (trainer.py), on a tiny random target on CPU."""

import copy

import pytest
import torch

from dflash_core.data import BatchStream, ShardedDataset
from dflash_core.drafter import DFlashDrafter, build_drafter_config
from dflash_core.target import default_layer_ids, load_target
from dflash_core.trainer import make_replicas, reduce_and_step

from .engine_fixtures import VOCAB, assets, make_config  # noqa: F401 - assets is a fixture


def head_copies(tm):
    embed = torch.nn.Embedding.from_pretrained(tm.embed_tokens.weight.detach().clone(), freeze=True)
    head = torch.nn.Linear(tm.hidden_size, tm.vocab_size, bias=False)
    head.weight = torch.nn.Parameter(tm.lm_head.weight.detach().clone(), requires_grad=False)
    return embed, head


def test_two_drafter_replicas_step_like_one_drafter_on_both_batches(tmp_path, assets):
    target, data = assets
    cfg = make_config(tmp_path, target, data)
    tm = load_target(target, device="cpu", dtype="float32")
    layer_ids = default_layer_ids(tm.num_layers, cfg.target.num_features)
    stream = BatchStream.from_config(ShardedDataset.open(data), cfg.data, seed=1, epochs=1)
    batches = list(stream.iter_batches())[:2]
    assert len(batches) == 2 and batches[0].indices != batches[1].indices
    feats = [tm.features(b.input_ids, b.attention_mask, layer_ids) for b in batches]

    dcfg = build_drafter_config(tm.model.config, num_layers=1, target_layer_ids=layer_ids,
                                block_size=4, mask_token_id=VOCAB - 1)
    torch.manual_seed(0)
    init = DFlashDrafter(dcfg)
    before = {k: v.clone() for k, v in init.state_dict().items()}
    cpu = torch.device("cpu")

    # Two replicas, one batch each.
    pair = make_replicas(copy.deepcopy(init), [cpu, cpu], cfg, *head_copies(tm))
    pair[0].accumulate(batches[0], feats[0], cfg.run.seed)
    pair[1].accumulate(batches[1], feats[1], cfg.run.seed)
    res_pair = reduce_and_step(pair, 0, 10)

    # One replica, both batches accumulated (grad_accum 2).
    (single,) = make_replicas(copy.deepcopy(init), [cpu], cfg, *head_copies(tm))
    single.accumulate(batches[0], feats[0], cfg.run.seed)
    single.accumulate(batches[1], feats[1], cfg.run.seed)
    res_single = reduce_and_step([single], 0, 10)

    assert res_pair.loss == pytest.approx(res_single.loss, rel=1e-5)
    assert res_pair.grad_norm == pytest.approx(res_single.grad_norm, rel=1e-4)
    assert res_pair.samples == res_single.samples == len(batches[0]) + len(batches[1])
    w_single = single.drafter.state_dict()
    moved = False
    for rep in pair:
        w = rep.drafter.state_dict()
        for name, value in w_single.items():
            torch.testing.assert_close(w[name], value, rtol=1e-5, atol=1e-6)
            if name in before and not torch.allclose(before[name], value):
                moved = True
    assert moved, "the optimizer step changed no weight: the comparison would prove nothing"
