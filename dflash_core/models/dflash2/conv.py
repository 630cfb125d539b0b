"""DFlash2's grouped dynamic causal convolution over block positions, and the decoder layer it
wraps (docs/algorithm.md "DFlash2").

One convolution per sublayer (attention, MLP) with a base kernel beta [2, T, H] (side 0 before
the sublayer, side 1 after it) and a projection W [2TM, H] (M = H / G groups). From the
normalised sublayer input y, Delta = y W^T is read as [p, side, tap, group] (row index
side*T*M + tap*M + group), and

    Conv_s(x)[p, c] = sum_t [p >= t] (beta[s, t, c] + Delta[p, s, t, c // G]) x[p - t, c]

with p the position inside the block: the coefficient comes from the output row, the taps look
back only, and never past the block's anchor (each block is zero-padded on its own). Both sides'
Delta come from the sublayer's input.

Numerics: vLLM runs the convolution in the model's dtype, op by op (the coefficient beta + Delta
rounded, each tap's product rounded, the running sum rounded after each tap), and so does this
one: in autocast's dtype under autocast (bf16 on the GPU, the served dtype), else in the input's.
``accumulate_in(torch.float32)`` computes it in float32 instead, the earlier numerics, for
measuring what the served rounding costs (bench/eval/dflash2_conv_precision.py).

Speed: on CUDA with Triton both passes run as conv_triton's kernels, one each instead of a
dozen elementwise passes over the block, rounding as these eager ones do (the forward and dx
bit for bit; Delta's and beta's float32 sums in another order). On the CPU, and after a kernel
has failed to build (said once), the eager passes below.

Memory: one autograd node per convolution that keeps only its input (in the conv's dtype) and
Delta; backward rebuilds the coefficients. The normalised input is cast once and shared by the
projection and the convolution, and the convolution's output (already in the compute dtype) is
what the sublayer's projections save: no float32 copies of the block per tap.

Identity initialisation (beta[:, 0] = 1, the other taps and W zero) makes the layer DFlash's
exactly: a fresh DFlash2 drafter computes what a DFlash drafter with the same weights does.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.models.compile_guard import is_compile_failure
from dflash_core.models.dflash.drafter import DrafterLayer
from dflash_core.models.dflash2 import conv_triton
from dflash_core.models.fused_loss.select import triton_installed

# The convolution's arithmetic dtype when set (accumulate_in); None: the model's (vLLM's).
_ACCUMULATE: torch.dtype | None = None


@contextlib.contextmanager
def accumulate_in(dtype: torch.dtype | None):
    """Every convolution computes in ``dtype`` while inside (None: the model's dtype, the
    default). A measuring switch for one process (bench), not a training setting."""
    global _ACCUMULATE
    before, _ACCUMULATE = _ACCUMULATE, dtype
    try:
        yield
    finally:
        _ACCUMULATE = before


def model_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the layer computes in at an input x: autocast's, else x's."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the convolution computes in at an input x (accumulate_in's, else the
    model's)."""
    return _ACCUMULATE if _ACCUMULATE is not None else model_dtype(x)


def conv_values(x: torch.Tensor, delta: torch.Tensor, beta: torch.Tensor,
                block: int) -> torch.Tensor:
    """Conv(x) in x's dtype, op by op as vLLM rounds it: x [n, L, H], delta [n, L, T, M] and
    beta [T, H] in that dtype, L a whole number of blocks."""
    n, L, H = x.shape
    T, M = delta.shape[-2:]
    G, A = H // M, L // block
    xb = x.view(n, A, block, M, G)
    d = delta.reshape(n, A, block, T, M, 1)
    bt = beta.view(T, M, G)
    out = (bt[0] + d[:, :, :, 0]) * xb
    for t in range(1, min(T, block)):
        # x[p - t] inside the block (p >= t): the rows of the block before p, never the last one's
        out[:, :, t:] += (bt[t] + d[:, :, t:, t]) * xb[:, :, : block - t]
    return out.view(n, L, H)


def conv_grads(g: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, beta: torch.Tensor,
               block: int, need: tuple[bool, bool, bool]):
    """(dx, dDelta, dbeta) of conv_values at the output gradient g (x's dtype): dx in x's dtype,
    each tap's products rounded as autograd of conv_values would; dDelta and dbeta summed in
    float32 (dDelta then in delta's dtype, dbeta float32)."""
    n, L, H = x.shape
    T, M = delta.shape[-2:]
    G, A = H // M, L // block
    taps = min(T, block)
    xb, gb = x.view(n, A, block, M, G), g.reshape(n, A, block, M, G)
    d = delta.reshape(n, A, block, T, M, 1)
    bt = beta.view(T, M, G)
    dx = dd = db = None
    if need[0]:
        dx = (bt[0] + d[:, :, :, 0]) * gb
        for t in range(1, taps):  # output row p reads row p - t: its gradient goes back there
            dx[:, :, : block - t] += (bt[t] + d[:, :, t:, t]) * gb[:, :, t:]
        dx = dx.view(n, L, H)
    if need[1] or need[2]:
        f32 = torch.float32
        dd = torch.zeros(n, A, block, T, M, dtype=f32, device=x.device) if need[1] else None
        db = torch.zeros(T, M, G, dtype=f32, device=x.device) if need[2] else None
        for t in range(taps):
            prod = gb[:, :, t:] * xb[:, :, : block - t]  # [n, A, B - t, M, G]
            if dd is not None:
                dd[:, :, t:, t] = prod.sum(-1, dtype=f32)
            if db is not None:
                db[t] = prod.sum((0, 1, 2), dtype=f32)
        if dd is not None:
            dd = dd.view(n, L, T, M).to(delta.dtype)
        if db is not None:
            db = db.view(T, H)
    return dx, dd, db


_kernels_failed = False


def use_kernels(x: torch.Tensor, group: int) -> bool:
    """Whether the convolution of x runs as conv_triton's kernels: on CUDA with Triton, in bf16
    or float32 with a power-of-two group size, until a kernel has once failed to build in this
    process."""
    return (x.is_cuda and not _kernels_failed and conv_triton.supported(group, x.dtype)
            and triton_installed())


def run_pass(name: str, eager, fused, x: torch.Tensor, group: int, *args):
    """``fused(*args)`` where use_kernels says so, else ``eager(*args)``. A kernel that fails to
    build (an old Triton, no compiler) leaves the process on the eager pass, with one warning
    naming the cause: the same arithmetic, only slower."""
    global _kernels_failed
    if use_kernels(x, group):
        try:
            return fused(*args)
        except Exception as exc:
            if not is_compile_failure(exc):
                raise
            _kernels_failed = True
            warnings.warn(f"DFlash2's convolution runs eagerly (slower, same values): its "
                          f"Triton {name} kernel failed to build: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:200] if str(exc) else ''}")
    return eager(*args)


class _Conv(torch.autograd.Function):
    """conv_values with a backward that keeps x and Delta only (beta is a parameter)."""

    @staticmethod
    def forward(ctx, x, delta, beta, block):
        low = beta.to(x.dtype)
        ctx.save_for_backward(x, delta, low)
        ctx.block, ctx.beta_dtype = block, beta.dtype
        group = x.shape[-1] // delta.shape[-1]
        return run_pass("forward", conv_values, conv_triton.conv_values, x, group, x, delta,
                        low, block)

    @staticmethod
    def backward(ctx, g):
        x, delta, low = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        g = g.to(x.dtype)
        group = x.shape[-1] // delta.shape[-1]
        dx, dd, db = run_pass("backward", conv_grads, conv_triton.conv_grads, x, group,
                              g, x, delta, low, ctx.block, need)
        return dx, dd, None if db is None else db.to(ctx.beta_dtype), None


class KernelProjection(nn.Module):
    """The bias-free map y -> Delta, [2TM, H], as ``kernel_projection.weight``. Not an
    nn.Linear: it is made at zero without drawing from the random generator, so a DFlash2
    drafter and a DFlash drafter seeded alike get the same backbone weights (the drafter's
    initialisation draws for nn.Linear only)."""

    def __init__(self, rows: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, hidden))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if torch.is_autocast_enabled(y.device.type):
            w = w.to(torch.get_autocast_dtype(y.device.type))
        return F.linear(y.to(w.dtype), w)


class BlockConv(nn.Module):
    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden % group_size:
            raise ValueError(f"conv_group_size {group_size} does not divide the width {hidden}")
        self.taps, self.group = int(kernel_size), int(group_size)
        self.groups = hidden // self.group
        base = torch.zeros(2, self.taps, hidden)
        base[:, 0] = 1.0  # identity: each position passes through unchanged
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = KernelProjection(2 * self.taps * self.groups, hidden)

    def prepare(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(y in the model's dtype, Delta [n, L, 2, T, M] in it) of the sublayer input y: one
        cast, shared by the projection and the side-0 convolution (one saved copy)."""
        low = y.to(model_dtype(y))
        delta = self.kernel_projection(low).to(low.dtype)
        return low, delta.view(*y.shape[:-1], 2, self.taps, self.groups)

    def coefficients(self, y: torch.Tensor) -> torch.Tensor:
        """Delta of the sublayer input y [n, L, H]: [n, L, 2, T, M] in the model's dtype."""
        return self.prepare(y)[1]

    def forward(self, x: torch.Tensor, delta: torch.Tensor, side: int,
                block_size: int) -> torch.Tensor:
        """Conv_side of x [n, L, H] (L = A*B: A blocks of ``block_size`` positions each) with
        ``delta`` from ``prepare``; computed in the conv's dtype, returned in the model's."""
        dt = compute_dtype(x)
        out = _Conv.apply(x.to(dt), delta[..., side, :, :].to(dt), self.base_kernel[side],
                          int(block_size))
        return out.to(model_dtype(x))


class DFlash2Layer(DrafterLayer):
    """DFlash's decoder layer (its attention over the context and the block, its MLP) with both
    sublayers wrapped: x += Conv_1(Attn(Conv_0(norm(x)))), then the same around the MLP. The
    context keys and values pass through no convolution (they are not block positions)."""

    def __init__(self, config):
        super().__init__(config)
        dc = config.dflash_config
        H, T, G = config.hidden_size, int(dc["conv_kernel_size"]), int(dc["conv_group_size"])
        self.attention_conv = BlockConv(H, T, G)
        self.mlp_conv = BlockConv(H, T, G)

    def forward(self, x, ctx, rope_blk, rope_ctx, anchors, block_size, impl, block_mask=None):
        conv = self.attention_conv
        y, delta = conv.prepare(self.input_layernorm(x))
        o = self.self_attn(conv(y, delta, 0, block_size), ctx, rope_blk, rope_ctx, anchors,
                           block_size, impl, block_mask)
        x = x + conv(o, delta, 1, block_size)
        conv = self.mlp_conv
        z, delta = conv.prepare(self.post_attention_layernorm(x))
        return x + conv(self.mlp(conv(z, delta, 0, block_size)), delta, 1, block_size)
