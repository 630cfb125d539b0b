"""DFlash2's convolution on CUDA runs compiled (models/dflash2/conv.py): at a drafter's width, in
bf16 as the engine trains, its forward and dx equal the eager passes bit for bit, Delta's and
beta's gradients agree to float32's rounding, and the compiled passes are what ran (no silent
fall-back to eager).

    pytest -q tests/gpu/test_dflash2_conv_gpu.py
"""

import pytest
import torch

from dflash_core.models.dflash2 import conv as conv_module

DEV = torch.device("cuda")


@pytest.mark.parametrize("taps,block", [(2, 8), (3, 16), (4, 2)], ids=["T2-B8", "T3-B16",
                                                                     "T4-B2"])
def test_the_compiled_convolution_is_the_eager_one(taps, block):
    n, A, H, G = 2, 48, 1024, 16
    M, L = H // G, A * block
    g = torch.Generator(device=DEV).manual_seed(taps)
    x = torch.randn(n, L, H, generator=g, device=DEV).to(torch.bfloat16)
    delta = (torch.randn(n, L, taps, M, generator=g, device=DEV) * 0.3).to(torch.bfloat16)
    beta = torch.randn(taps, H, generator=g, device=DEV)  # a float32 parameter, as trained
    up = torch.randn(n, L, H, generator=g, device=DEV).to(torch.bfloat16)
    got = [t.clone().requires_grad_() for t in (x, delta, beta)]
    out = conv_module._Conv.apply(got[0], got[1], got[2], block)
    out.backward(up)
    assert not conv_module._fused_failed
    assert {"values", "grads"} <= set(conv_module._fused)  # the compiled passes ran
    low = beta.to(torch.bfloat16)
    assert torch.equal(out, conv_module.conv_values(x, delta, low, block))
    dx, dd, db = conv_module.conv_grads(up, x, delta, low, block, (True, True, True))
    assert torch.equal(got[0].grad, dx)
    assert got[1].grad.dtype == dd.dtype and got[2].grad.dtype == torch.float32
    # Delta's gradient: float32 sums over 16 channels rounded to bf16 (one bf16 ulp apart where
    # the order flips a rounding); beta's: float32 sums over every row
    assert (got[1].grad.float() - dd.float()).abs().max() <= 2 ** -7 * dd.float().abs().max()
    assert (got[2].grad - db.float()).abs().max() <= 1e-4 * db.float().abs().max()
