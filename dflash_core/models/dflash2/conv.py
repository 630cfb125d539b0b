"""DFlash2's grouped dynamic causal convolution over block positions, and the decoder layer it
wraps (docs/algorithm.md "DFlash2").

One convolution per sublayer (attention, MLP) with a base kernel beta [2, T, H] (side 0 before
the sublayer, side 1 after it) and a projection W [2TM, H] (M = H / G groups). From the
normalised sublayer input y, Delta = y W^T is read as [p, side, tap, group] (row index
side*T*M + tap*M + group), and

    Conv_s(x)[p, c] = sum_t [p >= t] (beta[s, t, c] + Delta[p, s, t, c // G]) x[p - t, c]

with p the position inside the block: the coefficient comes from the output row, the taps look
back only, and never past the block's anchor (each block is zero-padded on its own). Both sides'
Delta come from the sublayer's input. It is accumulated in float32, as vLLM does.

Identity initialisation (beta[:, 0] = 1, the other taps and W zero) makes the layer DFlash's
exactly: a fresh DFlash2 drafter computes what a DFlash drafter with the same weights does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.models.dflash.drafter import DrafterLayer


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

    def coefficients(self, y: torch.Tensor) -> torch.Tensor:
        """Delta of the sublayer input y [n, L, H]: float32 [n, L, 2, T, M]."""
        return self.kernel_projection(y).float().view(*y.shape[:-1], 2, self.taps, self.groups)

    def forward(self, x: torch.Tensor, delta: torch.Tensor, side: int,
                block_size: int) -> torch.Tensor:
        """Conv_side of x [n, L, H] (L = A*B: A blocks of ``block_size`` positions each) with
        ``delta`` from ``coefficients``; float32 inside, x's dtype out."""
        n, L, H = x.shape
        B = int(block_size)
        A = L // B
        G, M = self.group, self.groups
        xf = x.float().view(n, A, B, H)
        d = delta[..., side, :, :].reshape(n, A, B, self.taps, M)
        beta = self.base_kernel[side].float()
        out = None
        for t in range(min(self.taps, B)):
            # x[p - t] inside the block, zero for p < t: shift along the block axis only
            xs = xf if t == 0 else F.pad(xf[:, :, : B - t], (0, 0, t, 0))
            term = beta[t] * xs + (d[..., t, :, None] * xs.view(n, A, B, M, G)).view(n, A, B, H)
            out = term if out is None else out + term
        return out.view(n, L, H).to(x.dtype)


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
        y = self.input_layernorm(x)
        conv = self.attention_conv
        delta = conv.coefficients(y)
        o = self.self_attn(conv(y, delta, 0, block_size), ctx, rope_blk, rope_ctx, anchors,
                           block_size, impl, block_mask)
        x = x + conv(o, delta, 1, block_size)
        z = self.post_attention_layernorm(x)
        conv = self.mlp_conv
        delta = conv.coefficients(z)
        return x + conv(self.mlp(conv(z, delta, 0, block_size)), delta, 1, block_size)
