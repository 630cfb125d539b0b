"""DFlash2's convolution on CUDA runs as Triton kernels (models/dflash2/conv_triton.py): at a
drafter's width, in bf16 as the engine trains, its forward, dx and Delta's gradient equal the
eager passes bit for bit and beta's gradient agrees to float32's rounding (its sum over every
row in another order); in float32 all agree to float32's rounding. And the kernels are what ran
(no silent fall-back to eager).

    pytest -q tests/gpu/test_dflash2_conv_gpu.py
"""

import pytest
import torch

from dflash_core.models.dflash2 import conv as conv_module
from dflash_core.models.dflash2 import conv_triton

DEV = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("taps,block,H,G", [(2, 8, 1024, 16), (3, 16, 1000, 8), (4, 2, 256, 256)],
                         ids=["T2-B8", "T3-B16-ragged", "T4-B2-wide-group"])
def test_the_kernels_compute_the_eager_passes(taps, block, H, G, dtype):
    n, A = 2, 37
    M, L = H // G, A * block
    g = torch.Generator(device=DEV).manual_seed(taps)
    x = torch.randn(n, L, H, generator=g, device=DEV).to(dtype)
    delta = (torch.randn(n, L, taps, M, generator=g, device=DEV) * 0.3).to(dtype)
    beta = torch.randn(taps, H, generator=g, device=DEV)  # a float32 parameter, as trained
    up = torch.randn(n, L, H, generator=g, device=DEV).to(dtype)
    assert conv_module.use_kernels(x, G)
    got = [t.clone().requires_grad_() for t in (x, delta, beta)]
    out = conv_module._Conv.apply(got[0], got[1], got[2], block)
    out.backward(up)
    assert not conv_module._kernels_failed and conv_triton.kernels.cache_info().currsize == 1
    low = beta.to(dtype)
    want = conv_module.conv_values(x, delta, low, block)
    dx, dd, db = conv_module.conv_grads(up, x, delta, low, block, (True, True, True))
    assert got[1].grad.dtype == dd.dtype and got[2].grad.dtype == torch.float32

    def close(a, b, tol):
        return (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()

    if dtype == torch.bfloat16:
        assert torch.equal(out, want)
        assert torch.equal(got[0].grad, dx)
        # Delta's: 16 (or 8, 256) float32 sums rounded to bf16: a flipped rounding is one ulp
        assert close(got[1].grad, dd, 2 ** -8)
    else:
        assert close(out, want, 1e-6) and close(got[0].grad, dx, 1e-6)
        assert close(got[1].grad, dd, 1e-5)
    assert close(got[2].grad, db, 1e-4)
