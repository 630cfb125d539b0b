"""The block-position convolution: identity at its start, causal over block positions, never
across a block, and the formula of the format (coefficient from the output row, row index
side*T*M + tap*M + group), checked against a loop written from it."""

import torch

from dflash_core.models.dflash2.conv import BlockConv

H, T, G = 32, 3, 8
M = H // G


def conv(seed=0):
    torch.manual_seed(seed)
    c = BlockConv(H, T, G)
    with torch.no_grad():
        c.base_kernel.normal_()
        c.kernel_projection.weight.normal_(0, 0.3)
    return c


def by_the_formula(c, x, y, side, B):
    """Conv_s(x)[p, c] = sum_t [p >= t] (beta[s,t,c] + Delta[p,s,t,c//G]) x[p-t, c], p the
    position inside each block, Delta = y W^T."""
    n, L, _ = x.shape
    W, beta = c.kernel_projection.weight, c.base_kernel
    out = torch.zeros(n, L, H)
    for i in range(n):
        for row in range(L):
            p, start = row % B, row - row % B
            delta = y[i, row] @ W.T  # [2TM]
            for t in range(T):
                if p < t:
                    continue
                for ch in range(H):
                    coef = beta[side, t, ch] + delta[side * T * M + t * M + ch // G]
                    out[i, row, ch] += coef * x[i, start + p - t, ch]
    return out


def test_equals_the_formula_on_both_sides():
    c = conv()
    B = 4
    x, y = torch.randn(2, 3 * B, H), torch.randn(2, 3 * B, H)
    with torch.no_grad():
        delta = c.coefficients(y)
        for side in (0, 1):
            assert torch.allclose(c(x, delta, side, B), by_the_formula(c, x, y, side, B),
                                  atol=1e-5)


def test_identity_at_its_start():
    c = BlockConv(H, T, G)
    x, y = torch.randn(2, 10, H), torch.randn(2, 10, H)
    with torch.no_grad():
        for side in (0, 1):
            assert torch.equal(c(x, c.coefficients(y), side, 5), x)


def test_causal_over_block_positions_and_never_across_a_block():
    c = conv(1)
    B, A = 5, 3
    x, y = torch.randn(1, A * B, H), torch.randn(1, A * B, H)
    with torch.no_grad():
        delta = c.coefficients(y)
        base = c(x, delta, 0, B)
        for row in range(A * B):
            bumped = x.clone()
            bumped[0, row] += 10.0
            moved = (c(bumped, delta, 0, B) - base).abs().amax(-1)[0] > 1e-4
            start = row - row % B
            # only the same block's rows p..p+T-1 (capped at the block's end) see the change
            want = torch.zeros(A * B, dtype=torch.bool)
            want[row: min(start + B, row + T)] = True
            assert torch.equal(moved, want), row
