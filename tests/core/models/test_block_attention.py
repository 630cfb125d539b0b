"""Both block-attention paths compute the masked attention a dense mask would."""

import math

import pytest
import torch

from dflash_core.models.block_attention import chunked_block_attention, flex_block_attention, make_block_mask


def dense(q, k_ctx, v_ctx, k_blk, v_blk, anchors, B, scale, causal=False):
    """Attention under the whole mask, written out (``causal``: a block position sees its block's
    positions up to its own, as vLLM's causal drafter attention does)."""
    n, h, Q, d = q.shape
    S = k_ctx.shape[2]
    rep = h // k_ctx.shape[1]
    k = torch.cat([k_ctx, k_blk], 2).repeat_interleave(rep, 1)
    v = torch.cat([v_ctx, v_blk], 2).repeat_interleave(rep, 1)
    blk = torch.arange(Q, device=q.device) // B
    mask = torch.zeros(n, 1, Q, S + Q, dtype=torch.bool, device=q.device)
    for b in range(n):
        anc = anchors[b][blk]
        mask[b, 0, :, :S] = torch.arange(S, device=q.device)[None] < anc[:, None]
        mask[b, 0, :, S:] = blk[:, None] == blk[None]
        if causal:
            rows = torch.arange(Q, device=q.device)
            mask[b, 0, :, S:] &= rows[None] <= rows[:, None]
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, -math.inf)
    return s.softmax(-1) @ v


def inputs(n=2, h=4, hkv=2, S=23, A=5, B=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    anchors = torch.stack([torch.sort(torch.randperm(S, generator=g)[:A]).values for _ in range(n)])
    anchors[1, -2:] = -1  # padding blocks
    return (r(n, h, A * B, d), r(n, hkv, S, d), r(n, hkv, S, d), r(n, hkv, A * B, d),
            r(n, hkv, A * B, d), anchors, B, d ** -0.5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk_elems", [1, 64, 1 << 22])
def test_chunked_equals_dense(chunk_elems, causal):
    args = inputs()
    want = dense(*args, causal=causal)
    got = chunked_block_attention(*args, chunk_elems=chunk_elems, causal=causal)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_flex_equals_dense(causal):
    args = inputs(seed=1)
    want = dense(*args, causal=causal)
    got = flex_block_attention(*args, compile=False, causal=causal)
    assert torch.allclose(got, want, atol=1e-5)


def test_causal_and_bidirectional_blocks_differ_only_after_the_first_position():
    """The two masks agree on a block's last position (it sees its whole block either way) and
    nowhere else in general: the flag is no no-op."""
    args = inputs(seed=2)
    B = args[6]
    both = dense(*args), chunked_block_attention(*args, causal=True)
    last = torch.arange(args[0].shape[2]) % B == B - 1
    assert torch.allclose(both[0][:, :, last], both[1][:, :, last], atol=1e-5)
    assert not torch.allclose(both[0][:, :, ~last], both[1][:, :, ~last], atol=1e-3)


def reference_block_mask(anchors, S, B, causal=False):
    """The same mask through create_block_mask (eager: it evaluates every query/key pair)."""
    from torch.nn.attention.flex_attention import create_block_mask

    n, A = anchors.shape
    Q = A * B

    def mask_mod(b, hh, q_idx, kv_idx):
        blk = q_idx // B
        in_ctx = kv_idx < S
        own = ~in_ctx & (((kv_idx - S) // B) == blk)
        if causal:
            own = own & (kv_idx - S <= q_idx)
        return (in_ctx & (kv_idx < anchors[b, blk])) | own

    return create_block_mask(mask_mod, B=n, H=None, Q_LEN=Q, KV_LEN=S + Q, device="cpu",
                             _compile=False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("S,A,B", [(700, 40, 16), (256, 64, 16), (300, 13, 5), (1000, 8, 32),
                                   (128, 8, 16)])
def test_block_mask_tiles_equal_create_block_mask(S, A, B, causal):
    g = torch.Generator().manual_seed(S + A)
    anchors = torch.stack([torch.sort(torch.randperm(S, generator=g)[:A]).values for _ in range(3)])
    anchors[2, -3:] = -1  # padding blocks
    anchors[1, : A // 2] = 0  # blocks that see no context
    got = make_block_mask(anchors, S, B, causal=causal)
    want = reference_block_mask(anchors, S, B, causal=causal)
    assert torch.equal(got.kv_num_blocks, want.kv_num_blocks)
    assert torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)
    # Same tiles listed (order within a row is free), and the same element mask.
    for mine, ref, num in [(got.kv_indices, want.kv_indices, want.kv_num_blocks),
                           (got.full_kv_indices, want.full_kv_indices, want.full_kv_num_blocks)]:
        for idx in torch.nonzero(num >= 0):
            k = int(num[tuple(idx)])
            assert sorted(mine[tuple(idx)][:k].tolist()) == sorted(ref[tuple(idx)][:k].tolist())
    assert torch.equal(got.to_dense(), want.to_dense())
    # And the backward's query-side tiles, derived from these.
    assert torch.equal(got.q_num_blocks, want.q_num_blocks)
    assert torch.equal(got.full_q_num_blocks, want.full_q_num_blocks)


def test_flex_with_built_mask_equals_dense_on_ragged_shapes():
    args = inputs(n=2, h=4, hkv=2, S=300, A=13, B=5, d=8, seed=3)
    want = dense(*args)
    assert torch.allclose(flex_block_attention(*args, compile=False), want, atol=1e-5)


def test_auto_picks_flex_on_gpu_only_for_head_dims_it_can_compile():
    from dflash_core.models.block_attention import resolve_impl

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_impl("auto", cuda, 128) == "flex"
    assert resolve_impl("auto", cuda, 8) == "chunked"  # inductor's flex needs >= 16
    assert resolve_impl("auto", cpu, 128) == "chunked"
    assert resolve_impl("chunked", cuda, 128) == "chunked"
    with pytest.raises(ValueError, match="head_dim >= 16"):
        resolve_impl("flex", cuda, 8)
    with pytest.raises(ValueError, match="unknown"):
        resolve_impl("dense", cpu, 8)


@pytest.mark.slow
def test_compiled_flex_stays_compiled_past_dynamos_default_recompile_limit():
    """Nine drafter shapes in one process (dynamo's default limit is 8): every one compiles; none
    falls back to eager FlexAttention, which would hold the whole score matrix."""
    import warnings

    from torch._dynamo.utils import counters

    from dflash_core.models.block_attention import compiled_flex

    torch._dynamo.reset()
    counters.clear()
    f = compiled_flex()
    S, A, B = 256, 4, 8  # (inductor's CPU FlexAttention fails to build some smaller shapes)
    anchors = torch.tensor([[20, 70, 130, 200]])
    mask = make_block_mask(anchors, S, B)
    with warnings.catch_warnings():
        # the eager fallback warns "flex_attention called without torch.compile()"
        warnings.simplefilter("error", UserWarning)
        for heads in (2, 4, 8):
            for dim in (16, 32, 64):
                q = torch.randn(1, heads, A * B, dim)
                k = torch.randn(1, heads, S + A * B, dim)
                f(q, k, torch.randn_like(k), block_mask=mask, scale=0.25)
    assert counters["stats"]["unique_graphs"] == 9


def test_the_compiled_flex_raises_dynamos_recompile_limit():
    from dflash_core.models.block_attention import FLEX_RECOMPILE_LIMIT, raise_recompile_limit

    cfg = torch._dynamo.config
    was = cfg.recompile_limit
    try:
        cfg.recompile_limit = 8
        raise_recompile_limit()
        assert cfg.recompile_limit == FLEX_RECOMPILE_LIMIT
        cfg.recompile_limit = 500  # a user's higher setting is kept
        raise_recompile_limit()
        assert cfg.recompile_limit == 500
    finally:
        cfg.recompile_limit = was
