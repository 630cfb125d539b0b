"""Attention of drafter blocks over the target context that precedes their anchor.

Queries are A blocks of B tokens each; keys are the S context tokens followed by the same A*B block
tokens. Block a sees context positions < anchor_a and the B tokens of its own block (bidirectional),
nothing else; with ``causal``, a block position sees its block's positions up to its own only (the
context as before: what vLLM computes for a drafter whose config.json says ``is_causal: true``).
Never a dense S x S copy per block:
- ``flex``: FlexAttention with a block-sparse mask (GPU; the kernel is compiled once per process,
  the tile map is computed from the anchors);
- ``chunked``: SDPA over groups of blocks, each group's keys cut to the context it can see, so memory
  is bounded by ``chunk_elems`` scores per head (any device; the reference for tests).
Both compute the same function; tests check it.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from dflash_core.models.compile_guard import SerialCompiled

# Upper bound on query x key scores materialised per head by the chunked path.
CHUNK_ELEMS = 1 << 22


def _expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def chunked_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size, scale,
                            chunk_elems: int = CHUNK_ELEMS, causal: bool = False):
    """q, k_blk, v_blk: [n, h(kv), A*B, d]; k_ctx, v_ctx: [n, hkv, S, d]; anchors: [n, A] (-1 =
    padding block, which then sees only itself)."""
    n, h, Q, d = q.shape
    rep = h // k_ctx.shape[1]
    B = block_size
    A = Q // B
    out = torch.empty_like(q)
    S = k_ctx.shape[2]
    for b in range(n):
        anc = anchors[b].tolist()
        a0 = 0
        while a0 < A:
            # Grow the group while its scores stay within budget.
            a1 = a0 + 1
            ctx_end = max(0, min(S, anc[a0]))
            while a1 < A:
                end = max(ctx_end, min(S, anc[a1]))
                if (a1 + 1 - a0) * B * (end + (a1 + 1 - a0) * B) > chunk_elems:
                    break
                ctx_end = end
                a1 += 1
            g = a1 - a0
            rows = slice(a0 * B, a1 * B)
            keys = torch.cat([k_ctx[b, :, :ctx_end], k_blk[b, :, rows]], dim=1)
            vals = torch.cat([v_ctx[b, :, :ctx_end], v_blk[b, :, rows]], dim=1)
            anc_t = torch.tensor(anc[a0:a1], device=q.device).clamp(min=0)
            row_anchor = anc_t.repeat_interleave(B)[:, None]  # [g*B, 1]
            ctx_pos = torch.arange(ctx_end, device=q.device)[None, :]
            rows_at = torch.arange(g * B, device=q.device)
            row_blk = rows_at // B
            own = row_blk[:, None] == row_blk[None, :]
            if causal:  # same block, and not after the row's own position
                own &= rows_at[None, :] <= rows_at[:, None]
            mask = torch.cat([ctx_pos < row_anchor, own], dim=1)
            out[b, :, rows] = F.scaled_dot_product_attention(
                q[b, :, rows], _expand_kv(keys[None], rep)[0], _expand_kv(vals[None], rep)[0],
                attn_mask=mask, scale=scale,
            )
            a0 = a1
    return out


_flex_lock = threading.Lock()
_flex: SerialCompiled | None = None


def compiled_flex() -> SerialCompiled:
    """The process's one compiled FlexAttention (one compile cache shared by every drafter
    thread; calls from several threads are serialised around compiles, see compile_guard)."""
    global _flex
    with _flex_lock:
        if _flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            raise_recompile_limit()
            _flex = SerialCompiled(flex_attention, dynamic=True)
        return _flex


# Each head count, head dim, dtype and grad mode is a graph of its own (sequence lengths and
# anchor counts are not: dynamic). Past dynamo's recompile limit (8) the call runs eagerly, which
# materialises the whole score matrix: several times the memory the plan counts, with no error.
# One process can pass 8 (the screen restarting runs of other drafters; the GPU tests did, and
# the recompute test then measured eager attention's peak).
FLEX_RECOMPILE_LIMIT = 64


def raise_recompile_limit() -> None:
    import torch._dynamo

    cfg = torch._dynamo.config
    # the names since torch 2.7; a torch without one keeps its own limit
    for name, limit in (("recompile_limit", FLEX_RECOMPILE_LIMIT),
                        ("accumulated_recompile_limit", 4 * FLEX_RECOMPILE_LIMIT)):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))


# FlexAttention's sparsity tile (rows and columns); its kernels skip empty tiles and apply the
# mask only inside partial ones.
SPARSE_TILE = 128


def _visible_per_tile(anchors: torch.Tensor, ctx_len: int, block_size: int, tile: int,
                      causal: bool = False):
    """For each sample, query row and key tile: how many of the tile's keys the row sees."""
    n, A = anchors.shape
    Q, S, B = A * block_size, ctx_len, block_size
    KV = S + Q
    dev = anchors.device
    blk = torch.arange(Q, device=dev) // B
    ctx_end = anchors[:, blk].clamp(0, S)  # row sees context [0, anchor); -1 (padding) sees none
    c0 = torch.arange(0, KV, tile, device=dev)
    c1 = (c0 + tile).clamp(max=KV)
    in_ctx = (torch.minimum(ctx_end[..., None], c1) - c0).clamp(min=0)  # [n, Q, T]
    own = S + blk * B  # row's own block: keys [own, own + B) (causal: up to the row itself)
    own_end = own + (torch.arange(Q, device=dev) % B + 1 if causal else B)
    in_own = (torch.minimum(own_end[:, None], c1) - torch.maximum(own[:, None], c0)).clamp(min=0)
    return in_ctx + in_own, c1 - c0


def make_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, causal: bool = False):
    """The block-sparse mask of one forward; built once and shared by every drafter layer
    (``causal``: a block position sees its block up to itself).

    The tile map is computed directly from the anchors (a few small tensor ops) instead of by
    ``create_block_mask``, whose compiled form took ~215 s to build on first use on an H200 (the
    drafter's first step waited for it) and whose eager form materialises the dense mask.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n, A = anchors.shape
    Q, S, B = A * block_size, ctx_len, block_size
    tile = SPARSE_TILE
    vis, width = _visible_per_tile(anchors, S, B, tile, causal)  # [n, Q, T], [T]
    qt = -(-Q // tile)
    pad = qt * tile - Q
    # Rows past Q do not exist: they count as seeing nothing, so such a tile is never "full"
    # (what create_block_mask decides for ragged edges too).
    vis = torch.nn.functional.pad(vis, (0, 0, 0, pad)).view(n, qt, tile, -1)
    any_seen = vis.amax(2) > 0
    full = (vis.amin(2) == tile) & (width == tile)
    partial = any_seen & ~full

    def as_blocks(sel):  # [n, qt, T] -> counts [n, 1, qt], indices (selected first) [n, 1, qt, T]
        num = sel.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num[:, None], idx[:, None]

    def mask_mod(b, hh, q_idx, kv_idx):
        blk = q_idx // B
        anchor = anchors[b, blk]
        in_ctx = kv_idx < S
        sees_ctx = in_ctx & (kv_idx < anchor)
        sees_own = (~in_ctx) & (((kv_idx - S) // B) == blk)
        if causal:
            sees_own = sees_own & (kv_idx - S <= q_idx)
        return sees_ctx | sees_own

    kv_num, kv_idx = as_blocks(partial)
    full_num, full_idx = as_blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile,
                                    mask_mod=mask_mod, seq_lengths=(Q, S + Q))


def flex_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size, scale,
                         compile: bool = True, block_mask=None, causal: bool = False):
    """``block_mask``: make_block_mask's for these anchors (its ``causal`` then rules)."""
    from torch.nn.attention.flex_attention import flex_attention

    if block_mask is None:
        block_mask = make_block_mask(anchors.to(q.device), k_ctx.shape[2], block_size, causal)
    keys = torch.cat([k_ctx, k_blk], dim=2)
    vals = torch.cat([v_ctx, v_blk], dim=2)
    fn = compiled_flex() if compile else flex_attention
    return fn(q, keys, vals, block_mask=block_mask, scale=scale,
              enable_gqa=k_ctx.shape[1] != q.shape[1])


# Compiled FlexAttention lowers only head dims of at least 16 (inductor raises NYI below; seen
# on an H200 with a tiny test model). Real drafters use 128.
FLEX_MIN_HEAD_DIM = 16


def resolve_impl(impl: str, device: torch.device, head_dim: int | None = None) -> str:
    """``auto``: flex on CUDA when the head dim allows it, else chunked."""
    flex_ok = head_dim is None or head_dim >= FLEX_MIN_HEAD_DIM
    if impl == "auto":
        return "flex" if device.type == "cuda" and flex_ok else "chunked"
    if impl not in ("flex", "chunked"):
        raise ValueError(f"unknown block attention impl {impl!r}; use auto, flex or chunked")
    if impl == "flex" and device.type == "cuda" and not flex_ok:
        raise ValueError(f"flex block attention needs head_dim >= {FLEX_MIN_HEAD_DIM} on GPU "
                         f"(this drafter has {head_dim}); use auto or chunked")
    return impl


def block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size, scale, impl="auto",
                    block_mask=None, causal: bool = False):
    if resolve_impl(impl, q.device, q.shape[-1]) == "flex":
        return flex_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size, scale,
                                    compile=q.is_cuda, block_mask=block_mask, causal=causal)
    return chunked_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size, scale,
                                   causal=causal)
