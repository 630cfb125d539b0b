"""Both block-attention paths compute the masked attention a dense mask would."""

import math

import pytest
import torch

from dflash_core.block_attention import chunked_block_attention, flex_block_attention


def dense(q, k_ctx, v_ctx, k_blk, v_blk, anchors, B, scale):
    n, h, Q, d = q.shape
    S = k_ctx.shape[2]
    rep = h // k_ctx.shape[1]
    k = torch.cat([k_ctx, k_blk], 2).repeat_interleave(rep, 1)
    v = torch.cat([v_ctx, v_blk], 2).repeat_interleave(rep, 1)
    blk = torch.arange(Q) // B
    mask = torch.zeros(n, 1, Q, S + Q, dtype=torch.bool)
    for b in range(n):
        anc = anchors[b][blk]
        mask[b, 0, :, :S] = torch.arange(S)[None] < anc[:, None]
        mask[b, 0, :, S:] = blk[:, None] == blk[None]
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


@pytest.mark.parametrize("chunk_elems", [1, 64, 1 << 22])
def test_chunked_equals_dense(chunk_elems):
    args = inputs()
    want = dense(*args)
    got = chunked_block_attention(*args, chunk_elems=chunk_elems)
    assert torch.allclose(got, want, atol=1e-5)


def test_flex_equals_dense():
    args = inputs(seed=1)
    want = dense(*args)
    got = flex_block_attention(*args, compile=False)
    assert torch.allclose(got, want, atol=1e-5)
