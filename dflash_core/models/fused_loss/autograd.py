"""The fused loss's autograd functions over the labelled rows of one micro-group.

Per chunk of rows the logits come from cuBLAS in the lm_head's dtype into one buffer reused for
every chunk (DSpark: three, the drafter's lm_head and Markov logits and the target's), a Triton
kernel streams each row (triton_kernels.py) and, when a gradient is wanted, leaves the gradient
of the weighted loss with respect to the logits in place of them; the matmuls back to the inputs
follow at once. So the forward pass makes the gradient too, from the per-row weights it is given
(the slot weights times the term's coefficient, known before the loss: DFlash's fixed decay,
DSpark's; D-PACE's are found first, objective.chunked_loss), and keeps per row only the
gradient with respect to the row's inputs: backward scales it by the one number it receives.
Nothing rows x vocabulary outlives its chunk, and no logits are recomputed.

Rounding follows the torch path step by step (the same GEMMs in the same dtype, the gradient of
the logits rounded to that dtype before its matmul, each chunk's Markov weight gradient rounded
before it is summed in float32), so the two agree to float32 noise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dflash_core.models.fused_loss import triton_kernels as kernels


class RowsOut(NamedTuple):
    loss: torch.Tensor  # the weighted sum of the terms over the rows (differentiable)
    ce: torch.Tensor  # [N] float32 cross-entropy per row (no gradient)
    l1: torch.Tensor | None  # [N] float32 L1 distance to the target's distribution (DSpark)
    preds: torch.Tensor  # [N] argmax of each row's logits


def _frozen(weight: torch.Tensor) -> None:
    if weight.requires_grad:
        raise ValueError("the fused loss takes the target's frozen lm_head; this one requires "
                         "a gradient: set drafter.fused_loss: off to train through it")


def _grad_wanted(*inputs: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in inputs)


class _CERows(torch.autograd.Function):
    """sum(coef * CE) over rows h [N, H] projected by the frozen W [V, H]."""

    @staticmethod
    def forward(ctx, h, weight, labels, coef, chunk, want_grad):
        N, V, dt = h.shape[0], weight.shape[0], weight.dtype
        ce = torch.empty(N, dtype=torch.float32, device=h.device)
        preds = torch.empty(N, dtype=torch.long, device=h.device)
        dh = torch.empty(N, weight.shape[1], dtype=dt, device=h.device) if want_grad else None
        z = torch.empty(min(chunk, N), V, dtype=dt, device=h.device)
        with torch.autocast(h.device.type, enabled=False):  # the matmuls in the head's dtype
            for s in range(0, N, chunk):
                e = min(s + chunk, N)
                zc = z[: e - s]
                torch.mm(h[s:e].to(dt), weight.t(), out=zc)
                kernels.ce_rows(zc, labels[s:e], coef[s:e], ce[s:e], preds[s:e], want_grad)
                if want_grad:  # zc now holds coef * (softmax - onehot)
                    torch.mm(zc, weight, out=dh[s:e])
        ctx.dh, ctx.h_dtype = dh, h.dtype
        ctx.mark_non_differentiable(ce, preds)
        return (coef * ce).sum(), ce, preds

    @staticmethod
    def backward(ctx, g, _g_ce, _g_preds):
        dh = ctx.dh.to(ctx.h_dtype).mul_(g)
        ctx.dh = None
        return dh, None, None, None, None, None


class _SparkRows(torch.autograd.Function):
    """sum(a * CE + b * L1) over rows with the drafter's logits W h + W2 e and the target's
    W t (W frozen, W2 trained)."""

    @staticmethod
    def forward(ctx, h, e, weight, w2, t, labels, a, b, chunk, need):
        N, V, dt = h.shape[0], weight.shape[0], weight.dtype
        dev = h.device
        w2d = w2.detach().to(dt)  # the Markov GEMM in the lm_head's dtype, as slot_logits
        ce = torch.empty(N, dtype=torch.float32, device=dev)
        l1 = torch.empty(N, dtype=torch.float32, device=dev)
        preds = torch.empty(N, dtype=torch.long, device=dev)
        want = any(need)
        dh = torch.empty(N, h.shape[1], dtype=dt, device=dev) if need[0] else None
        de = torch.empty(N, e.shape[1], dtype=dt, device=dev) if need[1] else None
        dw2 = torch.zeros(w2.shape, dtype=torch.float32, device=dev) if need[2] else None
        c = min(chunk, N)
        zl, zm, zt = (torch.empty(c, V, dtype=dt, device=dev) for _ in range(3))
        with torch.autocast(dev.type, enabled=False):  # the matmuls in the head's dtype
            for s in range(0, N, chunk):
                end = min(s + chunk, N)
                m = end - s
                eb = e[s:end].to(dt)
                torch.mm(h[s:end].to(dt), weight.t(), out=zl[:m])
                torch.mm(eb, w2d.t(), out=zm[:m])
                torch.mm(t[s:end].to(dt), weight.t(), out=zt[:m])
                kernels.spark_rows(zl[:m], zm[:m], zt[:m], labels[s:end], a[s:end], b[s:end],
                                   ce[s:end], l1[s:end], preds[s:end], want)
                dz = zt[:m]  # the gradient of the chunk's logits, written over the target's
                if need[0]:
                    torch.mm(dz, weight, out=dh[s:end])
                if need[1]:
                    torch.mm(dz, w2d, out=de[s:end])
                if need[2]:
                    dw2.add_(torch.mm(dz.t(), eb))  # rounded per chunk, summed in float32
        ctx.grads = (dh, de, dw2)
        ctx.dtypes = (h.dtype, e.dtype, w2.dtype)
        ctx.mark_non_differentiable(ce, l1, preds)
        return (a * ce).sum() + (b * l1).sum(), ce, l1, preds

    @staticmethod
    def backward(ctx, g, _g_ce, _g_l1, _g_preds):
        dh, de, dw2 = (None if x is None else x.to(dt).mul_(g)
                       for x, dt in zip(ctx.grads, ctx.dtypes))
        ctx.grads = None
        return dh, de, None, dw2, None, None, None, None, None, None


def ce_rows(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor,
            chunk: int) -> RowsOut:
    """DFlash's rows: h [N, H] (any float dtype; projected in W's), labels [N] (all labelled),
    coef [N] the weight of each row's CE. ``loss`` = sum(coef * CE), its gradient with respect
    to h made in this forward pass when one is wanted."""
    _frozen(weight)
    want = _grad_wanted(h)
    loss, ce, preds = _CERows.apply(h, weight, labels.contiguous(),
                                    coef.to(torch.float32).contiguous(), max(1, chunk), want)
    return RowsOut(loss, ce, None, preds)


def ce_stats(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
             chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE [N], argmax [N]) of DFlash's rows without a gradient (D-PACE's weights need every
    row's CE before the weighted pass)."""
    with torch.no_grad():
        ones = torch.ones(len(h), dtype=torch.float32, device=h.device)
        out = ce_rows(h.detach(), weight, labels, ones, chunk)
    return out.ce, out.preds


def spark_rows(h: torch.Tensor, e: torch.Tensor, weight: torch.Tensor, w2: torch.Tensor,
               t: torch.Tensor, labels: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               chunk: int) -> RowsOut:
    """DSpark's rows: h [N, H] drafter states, e [N, r] the Markov embeddings W1[prev], w2
    [V, r], t [N, H] the target's post-norm states there (no gradient), labels [N], a / b [N]
    the weights of each row's CE and L1. ``loss`` = sum(a * CE + b * L1), its gradients with
    respect to h, e and w2 made in this forward pass when wanted."""
    _frozen(weight)
    grad = torch.is_grad_enabled()
    need = tuple(grad and x.requires_grad for x in (h, e, w2))
    f32 = torch.float32
    loss, ce, l1, preds = _SparkRows.apply(h, e, weight, w2, t.detach(), labels.contiguous(),
                                           a.to(f32).contiguous(), b.to(f32).contiguous(),
                                           max(1, chunk), need)
    return RowsOut(loss, ce, l1, preds)
