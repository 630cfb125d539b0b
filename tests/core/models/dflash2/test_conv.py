"""The block-position convolution: identity at its start, causal over block positions, never
across a block, and the formula of the format (coefficient from the output row, row index
side*T*M + tap*M + group), checked against a loop written from it; in bf16 rounded op by op as
the served convolution is, in float32 on request, and its node's gradients."""

from types import SimpleNamespace

import pytest
import torch

from dflash_core.models.dflash2 import conv as conv_module
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


# ------------------------------------------------------------------------------------------------
# Numerics: the model's dtype, op by op (vLLM's), or float32 on request; the node's gradients
# ------------------------------------------------------------------------------------------------

def served_rounding(c, x, y, side, B):
    """The convolution as vLLM's runs it in bf16, written from its description: per tap the
    coefficient beta + Delta rounded to bf16, its product with the shifted input rounded, the
    taps added one by one (each sum rounded); Delta = y W^T from bf16 y and W."""
    bf = torch.bfloat16
    n, L, _ = x.shape
    W, beta = c.kernel_projection.weight.to(bf), c.base_kernel.to(bf)
    delta = (y.to(bf) @ W.T).view(n, L, 2, T, M)[:, :, side]  # [n, L, T, M]
    xb = x.to(bf)
    pos = torch.arange(L) % B
    out = None
    for t in range(T):
        coef = beta[side, t].view(M, G) + delta[:, :, t, :, None]  # [n, L, M, G], rounded
        shifted = torch.zeros_like(xb)
        shifted[:, t:] = xb[:, : L - t]
        term = (coef * shifted.view(n, L, M, G)).view(n, L, H) * (pos >= t).view(1, L, 1)
        out = term if out is None else out + term
    return out


def test_in_bf16_it_rounds_as_the_served_convolution_does():
    c = conv(2)
    B = 4
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 3 * B, H, generator=g), torch.randn(2, 3 * B, H, generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        low, delta = c.prepare(y)
        assert low.dtype == delta.dtype == torch.bfloat16
        for side in (0, 1):
            got = c(x.to(torch.bfloat16), delta, side, B)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, served_rounding(c, x, y, side, B)), side


def test_accumulate_in_float32_is_the_float32_formula():
    c = conv(3)
    B = 4
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 2 * B, H, generator=g).to(torch.bfloat16)
    y = torch.randn(2, 2 * B, H, generator=g)
    with torch.no_grad(), conv_module.accumulate_in(torch.float32):
        low, delta = c.prepare(y.to(torch.bfloat16))  # a bf16 model: Delta in bf16, as served
        assert delta.dtype == low.dtype == torch.bfloat16
        got = c.forward(x, delta, 1, B)
        assert got.dtype == torch.bfloat16  # back in the model's dtype for what follows
        wide = conv_module._Conv.apply(x.float(), delta[:, :, 1].float(), c.base_kernel[1], B)
    assert torch.equal(got, wide.to(torch.bfloat16))  # computed in float32, rounded once
    # Delta from the bf16 product, the rest in float32
    with torch.no_grad():
        want = by_the_formula(c, x.float(), y, 1, B)
        served = served_rounding(c, x.float(), y, 1, B).float()
    assert (wide - want).abs().max() < 0.05 * want.abs().max()  # only Delta's rounding apart
    assert not torch.equal(got, served.to(torch.bfloat16))  # the switch changes the arithmetic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_nodes_gradients_are_autograds_of_the_same_arithmetic(dtype):
    """The convolution's node (saves x and Delta, rebuilds the coefficients) against autograd
    through the same forward ops: the same rounded products, summed in another order (three
    taps here) and Delta's and beta's sums in float32: equal to the dtype's rounding."""
    B, A, n = 4, 3, 2
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, A * B, H, generator=g).to(dtype)
    delta = (torch.randn(n, A * B, T, M, generator=g) * 0.3).to(dtype)
    beta = torch.randn(T, H, generator=g)
    up = torch.randn(n, A * B, H, generator=g).to(dtype)
    got = [t.clone().requires_grad_() for t in (x, delta, beta)]
    ref = [t.clone().requires_grad_() for t in (x, delta, beta)]
    out = conv_module._Conv.apply(got[0], got[1], got[2], B)
    want = conv_module.conv_values(ref[0], ref[1], ref[2].to(dtype), B)
    assert torch.equal(out, want)
    (out.float() * up.float()).sum().backward()
    (want.float() * up.float()).sum().backward()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, b in zip(got, ref):
        assert a.grad.dtype == b.grad.dtype
        assert (a.grad.float() - b.grad.float()).norm() <= tol * b.grad.float().norm()


def test_a_block_shorter_than_the_kernel_has_no_gradient_past_its_taps():
    B, n, Tk = 2, 1, 3  # T 3 taps over blocks of 2: the last tap never reads a row
    g = torch.Generator().manual_seed(8)
    x = torch.randn(n, 2 * B, H, generator=g).requires_grad_()
    delta = torch.randn(n, 2 * B, Tk, M, generator=g).requires_grad_()
    beta = torch.randn(Tk, H, generator=g).requires_grad_()
    conv_module._Conv.apply(x, delta, beta, B).sum().backward()
    assert torch.all(delta.grad[:, :, 2] == 0) and torch.all(beta.grad[2] == 0)
    assert delta.grad[:, :, :2].abs().sum() > 0


# ------------------------------------------------------------------------------------------------
# What a layer saves for backward: the plan's Family.layer_saved_h, measured
# ------------------------------------------------------------------------------------------------

def saved_per_block_token(m, anchors):
    """Bytes autograd keeps (unique storages) over one forward under bf16 autocast."""
    from .tiny import B as TB, H as TH, LAYER_IDS

    g = torch.Generator().manual_seed(0)
    S = 40
    ctx = torch.randn(1, S, len(LAYER_IDS) * TH, generator=g)
    a = torch.arange(anchors)[None] * 2 + 1
    emb = torch.randn(1, anchors * TB, TH, generator=g)
    pos = (a[0, :, None] + torch.arange(TB)).view(1, -1)
    seen = {}

    def pack(x):
        st = x.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        m.train()(ctx, emb, pos, a)
    return sum(seen.values())


def test_the_layer_saves_what_the_memory_plan_counts():
    """The slope over block tokens (the context and the weights cancel) of DFlash2's saved
    bytes over DFlash's, per layer, in 2-byte units of H: the plan's layer_saved_h exactly (the
    old float32 convolution saved 19)."""
    from dflash_core.config import config_from_dict
    from dflash_core.families.dflash2 import DFLASH2

    from .tiny import B as TB, H as TH, dflash, dflash2

    def slope(m):
        return (saved_per_block_token(m, 12) - saved_per_block_token(m, 4)) / (8 * TB)

    layers = 2
    extra = (slope(dflash2(layers=layers)) - slope(dflash(layers=layers))) / (layers * TH * 2)
    d = config_from_dict({"drafter": {"objective": "dflash2", "block_size": TB}}).drafter
    assert extra == DFLASH2.layer_saved_h(d) == 1.0 + 4 * 2 / 16
    with conv_module.accumulate_in(torch.float32):  # the measure can fail: float32 saves more
        wide = (slope(dflash2(layers=layers)) - slope(dflash(layers=layers))) / (layers * TH * 2)
    assert wide > extra + 3


class CompilationError(Exception):
    """Stands for Triton's compiler error (what is_compile_failure knows it by: its module)."""


CompilationError.__module__ = "triton.compiler.errors"


def test_a_kernel_that_fails_to_build_leaves_the_eager_pass_and_says_so(monkeypatch):
    """A Triton kernel can fail to build on a node (an old Triton, no compiler): the
    convolution then runs its eager pass for the rest of the process, with one warning naming
    the cause; an error of the computation itself still raises."""
    monkeypatch.setattr(conv_module, "_kernels_failed", False)
    monkeypatch.setattr(conv_module, "triton_installed", lambda: True)
    x = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)  # all run_pass reads of its input
    eager_calls, fused_calls = [], []

    def eager(v):
        eager_calls.append(v)
        return v

    def broken(v):
        fused_calls.append(v)
        raise CompilationError("at 3:4: ptxas is too old")

    def wrong(v):
        raise ValueError("shapes do not match")

    with pytest.raises(ValueError, match="shapes do not match"):
        conv_module.run_pass("forward", eager, wrong, x, 16, 1)
    assert not conv_module._kernels_failed and eager_calls == []
    with pytest.warns(UserWarning, match="runs eagerly.*forward kernel.*ptxas is too old"):
        assert conv_module.run_pass("forward", eager, broken, x, 16, 2) == 2
    assert conv_module._kernels_failed
    assert conv_module.run_pass("backward", eager, broken, x, 16, 3) == 3  # no second try
    assert fused_calls == [2] and eager_calls == [2, 3]


def test_the_kernels_take_what_they_were_written_for():
    """conv_triton's kernels: bf16 and float32, power-of-two groups; everything else, and every
    CPU tensor, takes the eager passes."""
    from dflash_core.models.dflash2 import conv_triton

    assert conv_triton.supported(16, torch.bfloat16) and conv_triton.supported(1, torch.float32)
    assert not conv_triton.supported(24, torch.bfloat16)
    assert not conv_triton.supported(16, torch.float16)
    assert not conv_module.use_kernels(torch.zeros(1, 2, H, dtype=torch.bfloat16), G)
