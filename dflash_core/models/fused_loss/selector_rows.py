"""DFlash2's fused loss over the labelled rows of one micro-group: DFlash's CE on the unary
logits plus alpha times the selector's K-way CE (models/dflash2/loss.py is its reference and
says the formula), with nothing rows x vocabulary outliving its chunk and no logits recomputed.

Per chunk of rows, as the other fused losses (autograd.py): the logits z = W h in the lm_head's
dtype into one buffer reused for every chunk; the candidates are the top-K of that buffer (the
bf16 logits, as vLLM takes them: the unary transform is increasing, so these are u's top-K);
the selector's scores over those K and its gradients are small torch ops ([rows, K], [rows,
r]); the row kernel (triton_kernels.unary_rows on CUDA, ``unary_rows_torch`` anywhere else, the
same arithmetic) streams each row for the CE, the argmax and logsumexp(u), and with a gradient
wanted leaves the CE's gradient with respect to z in the buffer; the K candidates' entries are
then written again with both terms' gradient (the CE's and the selector's, summed in float32
before the one rounding to the lm_head's dtype, as autograd of the torch path rounds), and the
buffer goes back through W at once. The forward pass so makes every gradient (h; the gate's
weight W_h; both codebooks, dense float32 [V, r] sums) from the rows' known weights, and
backward scales them by the one number it receives.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dflash_core.models.dflash2.selector import unary
from dflash_core.models.fused_loss import triton_kernels as kernels


class SelectorRowsOut(NamedTuple):
    loss: torch.Tensor  # sum(coef_ce * CE + coef_sel * SEL) over the rows (differentiable)
    ce: torch.Tensor  # [N] float32 (no gradient)
    sel: torch.Tensor  # [N] float32, 0 where the label is not counted (drop, label missing)
    hit: torch.Tensor  # [N] float32: the label among the K candidates (before injecting)
    unary_preds: torch.Tensor  # [N] argmax of u
    choice: torch.Tensor  # [N] the selector's choice argmax_C S


def slope(z: torch.Tensor, multiplier: float, softcap: float) -> torch.Tensor:
    """du/dz in float32 of u = softcap(multiplier * z), at the logits z."""
    if softcap > 0:
        t = torch.tanh(z.float() * multiplier / softcap)
        return multiplier * (1.0 - t * t)
    return torch.full_like(z, multiplier, dtype=torch.float32)


def unary_rows_torch(z: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor | None,
                     ce: torch.Tensor, preds: torch.Tensor, lse: torch.Tensor,
                     multiplier: float, softcap: float, write_grad: bool) -> None:
    """triton_kernels.unary_rows in torch ops (the CPU's; the kernel's reference)."""
    if len(z) == 0:
        return
    u = unary(z, multiplier, softcap)
    lse.copy_(torch.logsumexp(u, -1))
    ce.copy_(lse - u.gather(1, labels[:, None]).squeeze(1))
    preds.copy_(u.argmax(-1))
    if write_grad:
        g = u.sub_(lse[:, None]).exp_()
        g[torch.arange(len(z), device=z.device), labels] -= 1.0
        g.mul_(coef[:, None]).mul_(slope(z, multiplier, softcap))
        z.copy_(g)


def row_kernel(z: torch.Tensor):
    """The row kernel for a logits buffer on z's device."""
    return kernels.unary_rows if z.is_cuda else unary_rows_torch


def pair_and_rows(a: torch.Tensor, succ: torch.Tensor, cand: torch.Tensor):
    """(<a, B[cand]> [c, K], B[cand] [c, K, r] float32)."""
    rows = succ[cand].float()
    return torch.bmm(rows, a[:, :, None]).squeeze(-1), rows


class _SelectorRows(torch.autograd.Function):

    @staticmethod
    def forward(ctx, h, weight, gate_w, pred, succ, labels, prev, coef_ce, coef_sel, k,
                multiplier, softcap, inject, chunk, need):
        N, V, dt, dev = h.shape[0], weight.shape[0], weight.dtype, h.device
        f32 = torch.float32
        want = any(need)
        out = [torch.empty(N, dtype=f32, device=dev) for _ in range(3)]  # ce, sel, hit
        uarg, choice = (torch.empty(N, dtype=torch.long, device=dev) for _ in range(2))
        lse = torch.empty(N, dtype=f32, device=dev)
        dh = torch.empty(N, h.shape[1], dtype=f32, device=dev) if need[0] else None
        dgw = torch.zeros(gate_w.shape, dtype=f32, device=dev) if need[1] else None
        dpred = torch.zeros(pred.shape, dtype=f32, device=dev) if need[2] else None
        dsucc = torch.zeros(succ.shape, dtype=f32, device=dev) if need[3] else None
        z = torch.empty(min(chunk, N), V, dtype=dt, device=dev)
        kernel = row_kernel(z)
        gw = gate_w.detach().float()
        with torch.autocast(dev.type, enabled=False):  # the matmuls in the head's dtype
            for s in range(0, N, chunk):
                e = min(s + chunk, N)
                zc, lab = z[: e - s], labels[s:e]
                torch.mm(h[s:e].to(dt), weight.t(), out=zc)
                cand = zc.topk(k, dim=-1).indices  # the candidates: not trained
                hit = (cand == lab[:, None]).any(1)
                if inject:
                    cand[:, -1] = torch.where(hit, cand[:, -1], lab)
                zk = zc.gather(1, cand)  # before the kernel writes the gradient over z
                U = unary(zk, multiplier, softcap)
                hf = h[s:e].detach().float()
                gate = hf @ gw.t()
                ap = pred.detach()[prev[s:e]].float()
                a = ap * gate
                pair, brows = pair_and_rows(a, succ.detach(), cand)
                S = U + pair
                is_label = cand == lab[:, None]
                at = is_label.float().argmax(1)  # the label's place (0 when absent)
                lse_s = torch.logsumexp(S, -1)
                counted = torch.ones_like(hit) if inject else hit
                sel = torch.where(counted, lse_s - S.gather(1, at[:, None]).squeeze(1), 0.0)
                out[1][s:e], out[2][s:e] = sel, hit.float()
                choice[s:e] = cand.gather(1, S.argmax(-1, keepdim=True)).squeeze(1)
                kernel(zc, lab, coef_ce[s:e], out[0][s:e], uarg[s:e], lse[s:e], multiplier,
                       softcap, want)
                if not want:
                    continue
                # the selector's gradient with respect to its scores S, [c, K]
                gs = (S - lse_s[:, None]).exp_()
                gs[torch.arange(e - s, device=dev), at] -= 1.0
                gs.mul_((coef_sel[s:e] * counted)[:, None])
                if need[0]:  # both terms' gradient at the candidates, rounded once
                    pk = (U - lse[s:e, None]).exp_().sub_(is_label.float())
                    gk = (pk * coef_ce[s:e, None] + gs) * slope(zk, multiplier, softcap)
                    zc.scatter_(1, cand, gk.to(dt))
                da = torch.bmm(gs[:, None, :], brows).squeeze(1)  # [c, r]
                dgate = da * ap
                if need[0]:
                    dh[s:e] = torch.mm(zc, weight).float() + dgate @ gw
                if dgw is not None:
                    dgw.add_(dgate.t() @ hf)
                if dpred is not None:
                    dpred.index_add_(0, prev[s:e], da * gate)
                if dsucc is not None:
                    r = a.shape[1]
                    dsucc.index_add_(0, cand.reshape(-1),
                                     (gs[:, :, None] * a[:, None, :]).reshape(-1, r))
        ce, sel, hitf = out
        ctx.grads = (dh, dgw, dpred, dsucc)
        ctx.dtypes = (h.dtype, gate_w.dtype, pred.dtype, succ.dtype)
        ctx.mark_non_differentiable(ce, sel, hitf, uarg, choice)
        loss = (coef_ce * ce).sum() + (coef_sel * sel).sum()
        return loss, ce, sel, hitf, uarg, choice

    @staticmethod
    def backward(ctx, g, *_):
        dh, dgw, dpred, dsucc = (None if x is None else x.to(dt).mul_(g)
                                 for x, dt in zip(ctx.grads, ctx.dtypes))
        ctx.grads = None
        return (dh, None, dgw, dpred, dsucc) + (None,) * 10


def selector_rows(h: torch.Tensor, weight: torch.Tensor, gate_w: torch.Tensor,
                  pred: torch.Tensor, succ: torch.Tensor, labels: torch.Tensor,
                  prev: torch.Tensor, coef_ce: torch.Tensor, coef_sel: torch.Tensor, *, k: int,
                  multiplier: float, softcap: float, inject: bool,
                  chunk: int) -> SelectorRowsOut:
    """DFlash2's rows: h [N, H] drafter states, the frozen lm_head ``weight`` [V, H], the
    selector's gate weight [r, H] and codebooks [V, r], labels and the teacher-forced
    predecessors [N] (every row labelled), coef_ce / coef_sel [N] each row's weight of its CE
    and its selector CE. ``loss`` = sum(coef_ce * CE + coef_sel * SEL), its gradients made in
    this forward pass when wanted."""
    if weight.requires_grad:
        raise ValueError("the fused loss takes the target's frozen lm_head; this one requires "
                         "a gradient: set drafter.fused_loss: off to train through it")
    grad = torch.is_grad_enabled()
    need = tuple(grad and x.requires_grad for x in (h, gate_w, pred, succ))
    f32 = torch.float32
    loss, ce, sel, hit, uarg, choice = _SelectorRows.apply(
        h, weight, gate_w, pred, succ, labels.contiguous(), prev.contiguous(),
        coef_ce.to(f32).contiguous(), coef_sel.to(f32).contiguous(), int(k), float(multiplier),
        float(softcap), bool(inject), max(1, int(chunk)), need)
    return SelectorRowsOut(loss, ce, sel, hit, uarg, choice)
