"""A 2-rank group's features equal one process's forward of the same weights (fp32, gloo), in
each mode, on a dense and two mixture-of-experts classes, at the layers the engine selects."""

import pytest
import torch

from dflash_core.models.target.config import default_layer_ids
from dflash_core.models.target.load import load_target

from ..models.target.target_classes import LAYERS, VOCAB, build
from .group_harness import reply, start_group, wait_loaded

TOL = 1e-5


def batch(seed: int, rows: int = 2, length: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, length - 3:] = 0  # right padding, as the loaders make it
    return ids, mask


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("group-targets")
    out = {}
    for name in ("qwen3_moe", "deepseek_v3"):
        build(name).save_pretrained(root / name)
        out[name] = root / name
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=LAYERS, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
                     ).save_pretrained(root / "qwen3")
    out["qwen3"] = root / "qwen3"
    return out


# One case of each mode in the fast suite; the rest with the slow trainings (`make test-slow`).
slow = pytest.mark.slow
CASES = [pytest.param("qwen3", "shared", False, marks=slow, id="qwen3-shared"),
         pytest.param("qwen3", "sharded", True, id="qwen3-sharded"),
         pytest.param("qwen3_moe", "sharded", False, marks=slow, id="qwen3_moe-sharded"),
         pytest.param("deepseek_v3", "sharded", False, marks=slow, id="deepseek_v3-sharded"),
         pytest.param("deepseek_v3", "shared", True, id="deepseek_v3-shared")]


@pytest.mark.parametrize("name, mode, last_hidden", CASES)
def test_group_features_equal_one_process(folders, tmp_path, name, mode, last_hidden):
    folder = folders[name]
    layers = default_layer_ids(LAYERS, 2)
    one = load_target(folder, dtype="float32")
    moe = name != "qwen3"
    group = start_group(folder, mode, moe, tmp_path, layer_ids=layers, last_hidden=last_hidden)
    try:
        wait_loaded(group)
        for step in range(2):
            # sharded: each rank its own batch, of another shape; shared: one batch for both
            sent = ([batch(10 * step + r, rows=2 + r, length=12 + 4 * r) for r in range(2)]
                    if mode == "sharded" else [batch(10 * step)] * 2)
            for r in range(2):
                group.requests[r].put(("batch", step + 1, *sent[r]))
            for r in range(2) if mode == "sharded" else [0]:
                _, seq, feats = reply(group, r, ("features",))
                ids, mask = sent[r]
                want = one.features(ids, mask, layers, with_last_hidden=last_hidden)
                assert seq == step + 1 and feats.shape == want.shape
                valid = mask.bool()
                err = float((feats[valid] - want[valid]).abs().max())
                assert err < TOL, f"rank {r}: {err}"
                feats = feats.clone()
                group.requests[r].put(("ack", seq))
        # sharded: rank 1's stream ends first; rank 0 still gets a batch while rank 1 runs
        # dummy forwards in step with it
        if mode == "sharded":
            group.requests[1].put(("end",))
            ids, mask = batch(99)
            group.requests[0].put(("batch", 9, ids, mask))
            _, seq, feats = reply(group, 0, ("features",))
            want = one.features(ids, mask, layers, with_last_hidden=last_hidden)
            assert float((feats[mask.bool()] - want[mask.bool()]).abs().max()) < TOL
            group.requests[0].put(("end",))
        else:
            for r in range(2):
                group.requests[r].put(("end",))
        for r in range(2):
            reply(group, r, ("done",))
    finally:
        forced = group.shutdown()
    assert forced == [] and all(p.exitcode == 0 for p in group.procs)
