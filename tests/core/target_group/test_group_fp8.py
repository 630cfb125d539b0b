"""FP8 block-wise targets in a 2-rank group (gloo, fp32 on the CPU): kept FP8 in each rank (the
CPU playing a GPU that keeps FP8, transformers' kernels not loading here), split by transformers'
own FP8 integration (tensor parallel, expert parallel, FSDP) and multiplied by the engine's
dequantizing matmul, the features equal one process's forward of the same checkpoint (loaded
dequantized, so of exactly the weights the FP8 ones stand for); on the CPU as such, dequantized
as it loads, too."""

import pytest
import torch

from dflash_core.models.target.config import default_layer_ids
from dflash_core.models.target.fp8 import checkpoint_bytes
from dflash_core.models.target.load import load_target
from dflash_core.observe.events import Log
from dflash_core.target_group import group as group_mod

from ..engine_fixtures import assets, make_config  # noqa: F401
from .fp8_targets import SMALL, VOCAB, rank_main_keeping_fp8, write_fp8
from .group_harness import reply, start_group
from .test_engine_group import losses

TOL = 1e-5
LAYERS = SMALL["num_hidden_layers"]


def batch(seed: int, rows: int = 2, length: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, length - 3:] = 0
    return ids, mask


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("group-fp8")
    return {name: write_fp8(root / name, name) for name in ("qwen3", "qwen3_moe", "deepseek_v3")}


# Tensor parallel (dense) and FSDP + expert parallel (DeepSeek-V3's shape) in the fast suite;
# the rest with the slow trainings (`make test-slow`).
slow = pytest.mark.slow
CASES = [pytest.param("qwen3", "shared", True, id="qwen3-shared-kept"),
         pytest.param("qwen3", "sharded", True, marks=slow, id="qwen3-sharded-kept"),
         pytest.param("qwen3_moe", "sharded", True, marks=slow, id="qwen3_moe-sharded-kept"),
         pytest.param("qwen3_moe", "shared", True, marks=slow, id="qwen3_moe-shared-kept"),
         pytest.param("deepseek_v3", "sharded", True, id="deepseek_v3-sharded-kept"),
         pytest.param("deepseek_v3", "shared", True, marks=slow, id="deepseek_v3-shared-kept"),
         pytest.param("qwen3_moe", "sharded", False, marks=slow,
                      id="qwen3_moe-sharded-dequantized")]


@pytest.mark.parametrize("name, mode, kept", CASES)
def test_fp8_group_features_equal_one_process(folders, tmp_path, monkeypatch, name, mode, kept):
    folder = folders[name]
    layers = default_layer_ids(LAYERS, 2)
    one = load_target(folder, dtype="float32")  # dequantized as it loads (the CPU)
    if kept:
        monkeypatch.setattr(group_mod, "rank_main", rank_main_keeping_fp8)
    group = start_group(folder, mode, name != "qwen3", tmp_path, layer_ids=layers)
    try:
        loaded = [reply(group, r, ("loaded",)) for r in range(2)]
        note = loaded[0][3]
        assert loaded[1][3] is None  # rank 0 says it for the group
        stored, plain = checkpoint_bytes([folder / "model.safetensors"], torch.float32)
        if kept:
            assert note.kept and note.line.startswith(
                "target: FP8 block-wise weights stay FP8 on the group's 2 ranks")
            assert "run by the engine's FP8 linear (each weight dequantized as it is used): " \
                   "transformers' FP8 kernels do not run here" in note.line, note.line
            # the ranks hold float8 weights (a byte a value) and their scales, not float32 ones
            # (FP8 dequantized, the two would hold more than the copy's plain bytes)
            held = sum(msg[1] for msg in loaded)
            assert held < 0.6 * plain and held >= stored
        else:
            assert not note.kept and "the target runs on the CPU" in note.line
        for step in range(2):
            sent = ([batch(10 * step + r, rows=2 + r, length=12 + 4 * r) for r in range(2)]
                    if mode == "sharded" else [batch(10 * step)] * 2)
            for r in range(2):
                group.requests[r].put(("batch", step + 1, *sent[r]))
            for r in range(2) if mode == "sharded" else [0]:
                _, seq, feats = reply(group, r, ("features",))
                ids, mask = sent[r]
                want = one.features(ids, mask, layers)
                valid = mask.bool()
                assert seq == step + 1 and feats.shape == want.shape
                err = float((feats[valid] - want[valid]).abs().max())
                assert err < TOL, f"rank {r}: {err}"
                group.requests[r].put(("ack", seq))
        for r in range(2):
            group.requests[r].put(("end",))
        for r in range(2):
            reply(group, r, ("done",))
    finally:
        forced = group.shutdown()
    assert forced == [] and all(p.exitcode == 0 for p in group.procs)


@pytest.mark.slow
def test_a_run_of_an_fp8_group_trains_as_one_process_of_the_same_checkpoint(
        folders, assets, tmp_path, monkeypatch):  # noqa: F811
    """The engine with one 2-rank sharded group keeping a Qwen3-MoE FP8 checkpoint FP8 trains to
    the losses of one process holding it dequantized; the run's log says once how rank 0 holds
    the weights."""
    _, data = assets
    folder = folders["qwen3_moe"]
    one, _ = losses(make_config(tmp_path / "one", folder, data, data__eval_prompts=0,
                                target__layer_ids=[1, 2]))
    monkeypatch.setattr(group_mod, "rank_main", rank_main_keeping_fp8)
    got, rec = losses(make_config(tmp_path / "group", folder, data, data__eval_prompts=0,
                                  target__layer_ids=[1, 2], layout__targets=[0, 1],
                                  target__gpus_per_copy=2))
    assert len(got) == 6 and got == pytest.approx(one, rel=1e-5)
    said = [e.message for e in rec.of(Log) if "stay FP8 on the group's 2 ranks" in e.message]
    assert len(said) == 1 and "the engine's FP8 linear" in said[0]
