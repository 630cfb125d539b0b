"""The drafter: interchange format, and equality with the public reference implementation."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from dflash_core.models.dflash.drafter import DFlashDrafter, RMSNorm, build_drafter_config
from tests.reference_impl import find_reference



def tiny_target_config():
    return Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def make_drafter(seed=0, layers=2, block=8):
    cfg = build_drafter_config(tiny_target_config(), num_layers=layers, target_layer_ids=[1, 3, 5],
                               block_size=block, mask_token_id=299)
    torch.manual_seed(seed)
    m = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():  # norms away from 1 so a wrong norm shows up
            p.normal_(0, 0.2)
    return m


@pytest.fixture(scope="session")
def reference_dflash():
    """The reference's ``DFlashDraftModel``; these CPU tests need it (CI's pip reaches an index)."""
    cls, how = find_reference()
    assert cls is not None, how
    return cls


EXPECTED_KEYS = {
    f"layers.{i}.{name}"
    for i in range(2)
    for name in [
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "input_layernorm.weight", "post_attention_layernorm.weight",
    ]
} | {"norm.weight", "fc.weight", "hidden_norm.weight"}


def test_checkpoint_is_the_interchange_format(tmp_path):
    m = make_drafter()
    m.attach_target_head(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 300, bias=False))
    m.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["num_target_layers"] == 8
    # the keys that change what vLLM computes, stated (models/served_keys.py)
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 3, 5], "block_size": 8,
                                    "mask_token_id": 299, "causal": False, "use_swa": False,
                                    "attention_sink_bias": False}
    assert cfg["is_causal"] is False and cfg["is_neox_style"] is True
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert keys == EXPECTED_KEYS  # no embedding, no lm_head, no rotary buffers


def test_save_load_round_trip(tmp_path):
    m = make_drafter()
    m.save(tmp_path)
    m2 = DFlashDrafter.load(tmp_path)
    ctx, emb = torch.randn(1, 9, 192), torch.randn(1, 8, 64)
    pos, anchors = torch.arange(9, 17)[None], torch.tensor([[9]])
    with torch.no_grad():
        assert torch.equal(m(ctx, emb, pos, anchors), m2(ctx, emb, pos, anchors))


@pytest.mark.parametrize("ctx_len", [1, 13, 40])
def test_matches_reference_implementation(tmp_path, reference_dflash, ctx_len):
    m = make_drafter(seed=ctx_len)
    m.save(tmp_path)
    ref = reference_dflash.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    B = m.block_size
    torch.manual_seed(1)
    ctx = torch.randn(1, ctx_len, 3 * 64)
    emb = torch.randn(1, B, 64)
    pos = torch.arange(ctx_len + B)[None]
    with torch.no_grad():
        want = ref(position_ids=pos, noise_embedding=emb, target_hidden=ctx)
        got = m(ctx, emb, pos[:, ctx_len:], torch.tensor([[ctx_len]]))
    assert want.shape == got.shape
    assert (want - got).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_is_qwen3s_norm(dtype):
    """Same function and gradients as transformers' Qwen3RMSNorm, with fp32 weights as the trainer
    keeps them; bf16 inputs differ by one rounding (Qwen3's rounds before the weight multiplies)."""
    torch.manual_seed(0)
    ours, theirs = RMSNorm(64, eps=1e-6), Qwen3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_(1, 0.3)
        theirs.weight.copy_(ours.weight)
    x = (torch.randn(3, 5, 64) * 4).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = ours(xa), theirs(xb)
    assert a.dtype == b.dtype == torch.float32
    g = torch.randn_like(a)
    (a * g).sum().backward()
    (b * g).sum().backward()
    rel = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: a few of its 2^-8 roundings

    def close(u, v):
        return (u.float() - v.float()).abs().max().item() <= rel * v.float().abs().max().item()
    assert close(a, b) and close(ours.weight.grad, theirs.weight.grad) and close(xa.grad, xb.grad)
    # a wrong epsilon or a missing weight would not pass
    assert not torch.allclose(RMSNorm(64)(x.float()), b.detach(), atol=1e-3)


def test_many_blocks_in_one_pass_equal_one_block_at_a_time():
    """Training runs all blocks of a sequence at once; each must equal drafting that block alone."""
    m = make_drafter(seed=3)
    B, S = m.block_size, 30
    ctx = torch.randn(1, S, 192)
    anchors = torch.tensor([[4, 11, 12, 25]])
    emb = torch.randn(1, 4 * B, 64)
    pos = (anchors[0, :, None] + torch.arange(B)).view(1, -1)
    with torch.no_grad():
        joint = m(ctx, emb, pos, anchors)
        for a, p in enumerate(anchors[0].tolist()):
            alone = m(ctx[:, :p], emb[:, a * B:(a + 1) * B], pos[:, a * B:(a + 1) * B],
                      torch.tensor([[p]]))
            assert torch.allclose(joint[:, a * B:(a + 1) * B], alone, atol=1e-5)


def test_bf16_autocast_stays_close_to_fp32():
    """The GPU path trains under bf16 autocast (attention inputs cast to bf16)."""
    m = make_drafter(seed=5)
    ctx, emb = torch.randn(1, 9, 192), torch.randn(1, 8, 64)
    pos, anchors = torch.arange(9, 17)[None], torch.tensor([[9]])
    with torch.no_grad():
        full = m(ctx, emb, pos, anchors)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = m(ctx, emb, pos, anchors)
    assert torch.allclose(full, low.float(), atol=0.05)
    assert not torch.equal(full, low.float())  # bf16 really ran
