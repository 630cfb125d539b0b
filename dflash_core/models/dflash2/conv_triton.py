"""DFlash2's convolution as two Triton kernels (CUDA): the forward, and one backward that gives
dx, dDelta and beta's per-tile partial sums together. Each program takes a tile of rows (block
positions, any block) by a tile of channels (whole groups) and reads the taps' neighbour rows by
address, masked to its own block; eager torch (conv.py's conv_values / conv_grads) makes a dozen
passes over the block's activations for the same arithmetic, which at the 8B shape cost more
than the drafter's attention.

The arithmetic is conv.py's, rounding for rounding: in bf16 every op's result is rounded to it
as eager torch rounds (the coefficient beta + Delta, each tap's product,
the running sum after each tap; bf16 only, fp16 stays eager); Delta's and beta's gradients sum the rounded products in
float32 (in another order than torch's: float32's rounding apart). In float32 nothing is rounded.

Triton is imported on first use only (a CPU machine without it imports this module cleanly);
conv.py calls here only for CUDA tensors with Triton installed and a power-of-two group size.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from dflash_core.models.fused_loss.triton_kernels import on_device

# Bound by kernels(): the kernels' bodies read these names (rounded too) from the module's
# globals when Triton compiles them.
triton = None
tl = None
rounded = None

ROWS = 32  # rows (block positions) a program takes
MAX_CHANNELS = 128  # channels a program takes (whole groups; more when one group is wider)


def channel_tile(group: int) -> int:
    return max(MAX_CHANNELS, group)


def supported(group: int, dtype: torch.dtype) -> bool:
    """Whether the kernels take this group size (a power of two: a tile holds whole groups) and
    dtype (bf16, the engine's, or float32; fp16 stays eager)."""
    return group > 0 and group & (group - 1) == 0 and dtype in (torch.bfloat16, torch.float32)


@functools.cache
def kernels() -> SimpleNamespace:
    global triton, tl, rounded
    import triton as _triton
    import triton.language as _tl
    triton, tl = _triton, _tl

    @triton.jit
    def _rounded(v, LOW: tl.constexpr):
        """v (float32) rounded to bf16 (kept in float32) as an eager op rounds its result: to
        nearest, ties to even, on the bits (one rule wherever the kernel runs: Triton's CPU
        interpreter truncates a bf16 cast)."""
        if LOW:
            u = v.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            v = u.to(tl.float32, bitcast=True)
        return v

    rounded = _rounded

    @triton.jit
    def conv_fwd(x_ptr, d_ptr, beta_ptr, out_ptr, R, H, M, block,
                 T: tl.constexpr, G: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                 LOW: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        r = rows.to(tl.int64)[:, None]
        c = cols[None, :]
        p = (rows % block)[:, None]  # position inside the block
        live = (r < R) & (c < H)
        dtype = out_ptr.dtype.element_ty
        out = tl.zeros((BR, BC), dtype=tl.float32)
        for t in tl.static_range(T):
            ok = live & (p >= t)
            b = tl.load(beta_ptr + t * H + c, mask=c < H, other=0.0).to(tl.float32)
            d = tl.load(d_ptr + r * (T * M) + t * M + c // G, mask=ok, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + (r - t) * H + c, mask=ok, other=0.0).to(tl.float32)
            prod = rounded(rounded(b + d, LOW) * xv, LOW)
            if t == 0:
                out = prod
            else:
                out = tl.where(ok, rounded(out + prod, LOW), out)
        tl.store(out_ptr + r * H + c, out.to(dtype), mask=live)

    @triton.jit
    def conv_bwd(g_ptr, x_ptr, d_ptr, beta_ptr, dx_ptr, dd_ptr, db_ptr, R, H, M, block,
                 T: tl.constexpr, G: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                 LOW: tl.constexpr):
        pid_r = tl.program_id(0)
        rows = pid_r * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        r = rows.to(tl.int64)[:, None]
        c = cols[None, :]
        p = (rows % block)[:, None]
        live = (r < R) & (c < H)
        dtype = dx_ptr.dtype.element_ty
        gv = tl.load(g_ptr + r * H + c, mask=live, other=0.0).to(tl.float32)
        dx = tl.zeros((BR, BC), dtype=tl.float32)
        groups = tl.program_id(1) * (BC // G) + tl.arange(0, BC // G)
        for t in tl.static_range(T):
            b = tl.load(beta_ptr + t * H + c, mask=c < H, other=0.0).to(tl.float32)
            # dx: output row r + t read this row at tap t (inside the block: p + t < block)
            fwd = live & (p + t < block)
            d = tl.load(d_ptr + (r + t) * (T * M) + t * M + c // G, mask=fwd,
                        other=0.0).to(tl.float32)
            gt = tl.load(g_ptr + (r + t) * H + c, mask=fwd, other=0.0).to(tl.float32)
            prod = rounded(rounded(b + d, LOW) * gt, LOW)
            if t == 0:
                dx = prod
            else:
                dx = tl.where(fwd, rounded(dx + prod, LOW), dx)
            # dDelta and dbeta: this output row's gradient times the row it read at tap t
            back = live & (p >= t)
            xv = tl.load(x_ptr + (r - t) * H + c, mask=back, other=0.0).to(tl.float32)
            gx = tl.where(back, rounded(gv * xv, LOW), 0.0)
            dd = tl.sum(tl.reshape(gx, (BR, BC // G, G)), 2)
            tl.store(dd_ptr + r * (T * M) + t * M + groups[None, :],
                     rounded(dd, LOW).to(dd_ptr.dtype.element_ty),
                     mask=(r < R) & (groups[None, :] < M))
            tl.store(db_ptr + (pid_r * T + t) * H + cols, tl.sum(gx, 0), mask=cols < H)
        tl.store(dx_ptr + r * H + c, dx.to(dtype), mask=live)

    return SimpleNamespace(conv_fwd=conv_fwd, conv_bwd=conv_bwd)


def _grid(R: int, H: int, G: int):
    return (triton.cdiv(R, ROWS), triton.cdiv(H, channel_tile(G)))


def conv_values(x: torch.Tensor, delta: torch.Tensor, beta: torch.Tensor,
                block: int) -> torch.Tensor:
    """conv.py's conv_values (x [n, L, H], delta [n, L, T, M], beta [T, H], one dtype)."""
    n, L, H = x.shape
    T, M = delta.shape[-2:]
    k = kernels()
    x, delta, beta = x.contiguous(), delta.contiguous(), beta.contiguous()
    out = torch.empty_like(x)
    R, G = n * L, H // M
    with on_device(x):
        k.conv_fwd[_grid(R, H, G)](x, delta, beta, out, R, H, M, block, T=T, G=G, BR=ROWS,
                                   BC=channel_tile(G), LOW=x.dtype != torch.float32)
    return out


def conv_grads(g: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, beta: torch.Tensor,
               block: int, need: tuple[bool, bool, bool]):
    """(dx in x's dtype, dDelta in delta's, dbeta float32 [T, H]) as conv.py's conv_grads, None
    where ``need`` says no (one kernel computes all three)."""
    n, L, H = x.shape
    T, M = delta.shape[-2:]
    k = kernels()
    g, x, delta, beta = g.contiguous(), x.contiguous(), delta.contiguous(), beta.contiguous()
    R, G = n * L, H // M
    grid = _grid(R, H, G)
    dx = torch.empty_like(x)
    dd = torch.empty_like(delta)
    parts = torch.empty(grid[0], T, H, dtype=torch.float32, device=x.device)
    with on_device(x):
        k.conv_bwd[grid](g, x, delta, beta, dx, dd, parts, R, H, M, block, T=T, G=G, BR=ROWS,
                         BC=channel_tile(G), LOW=x.dtype != torch.float32)
    return (dx if need[0] else None, dd if need[1] else None,
            parts.sum(0) if need[2] else None)
