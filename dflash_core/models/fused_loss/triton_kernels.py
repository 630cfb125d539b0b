"""The fused loss's Triton kernels: one program per row streams that row's logits over the
vocabulary in blocks, with an online softmax (running max and sum), and leaves a few scalars per
row; with ``write_grad`` a last sweep overwrites the logits with the gradient of the weighted
loss with respect to them. The logits themselves come from cuBLAS beside the kernel (autograd.py):
a GEMM in the lm_head's dtype runs near the card's peak, while a matmul inside the kernel would
be made again for every sweep (DSpark's TV needs both normalisers before its second).

Triton is imported by ``kernels()`` on first use, never when this module is imported: the engine
asks for the kernels only on a CUDA drafter with Triton installed (select.py), and a CPU machine
without Triton imports this module cleanly.

The kernels compute the quantities of the torch path (models/objective.py, models/dspark/loss.py,
models/dflash2/loss.py: unary_rows reads the logits through DFlash2's multiplier and softcap):
float32 arithmetic on the logits as stored (bf16 rounded by the GEMM, as the torch path's
``F.linear(...).float()``), CE = logsumexp(z) - z[label], the argmax the first index of the
largest logit, and DSpark's z = z_lm + z_markov summed in float32.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import torch

# Bound by kernels(): the kernels' bodies read these names from the module's globals when Triton
# compiles them, so they must be the modules, set before the first compile.
triton = None
tl = None

MAX_BLOCK = 4096  # vocabulary entries a program holds at once (V is looped over in blocks)
NUM_WARPS = 8


def block_for(vocab: int) -> int:
    """The vocabulary block: a power of two, at most MAX_BLOCK (a small vocabulary in one)."""
    return min(MAX_BLOCK, 1 << max(4, (vocab - 1).bit_length()))


@functools.cache
def kernels() -> SimpleNamespace:
    """Import Triton and define the kernels (once per process)."""
    global triton, tl
    import triton as _triton
    import triton.language as _tl
    triton, tl = _triton, _tl

    @triton.jit
    def ce_rows(z_ptr, stride, labels_ptr, coef_ptr, ce_ptr, arg_ptr, V,
                BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr):
        """Per row: CE and argmax of the logits z; with WRITE_GRAD z becomes
        coef * (softmax(z) - onehot(label)), the gradient of coef * CE."""
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        offs = tl.arange(0, BLOCK)
        m = -float("inf")  # running max
        s = 0.0  # running sum of exp(z - m)
        best = -float("inf")
        best_i = 0
        for start in range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < V, other=-float("inf")).to(tl.float32)
            bm = tl.max(x, 0)
            bi = tl.argmax(x, 0)  # the first of equal maxima, as torch's argmax
            best_i = tl.where(bm > best, start + bi, best_i)  # a later block must be larger
            best = tl.maximum(best, bm)
            m_new = tl.maximum(m, bm)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        label = tl.load(labels_ptr + row)
        ce = lse - tl.load(base + label).to(tl.float32)
        tl.store(ce_ptr + row, ce)
        tl.store(arg_ptr + row, best_i.to(tl.int64))
        if WRITE_GRAD:
            a = tl.load(coef_ptr + row)
            for start in range(0, V, BLOCK):
                idx = start + offs
                inside = idx < V
                x = tl.load(base + idx, mask=inside, other=-float("inf")).to(tl.float32)
                g = a * (tl.exp(x - lse) - tl.where(idx == label, 1.0, 0.0))
                tl.store(base + idx, g.to(z_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)

    @triton.jit
    def spark_rows(zl_ptr, zm_ptr, zt_ptr, stride, labels_ptr, a_ptr, b_ptr, ce_ptr, l1_ptr,
                   arg_ptr, V, BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr):
        """Per row, with z = zl + zm (the drafter's lm_head and Markov logits, summed in
        float32) and the target's logits zt: CE of z, the L1 distance between softmax(z) and
        softmax(zt), the argmax of z. With WRITE_GRAD zt becomes the gradient of
        a * CE + b * L1 with respect to z:
        p * (b * (s - <p, s>) + a) - a * onehot(label), p = softmax(z), s = sign(p - p_t)."""
        row = tl.program_id(0)
        off = row.to(tl.int64) * stride
        offs = tl.arange(0, BLOCK)
        md = -float("inf")
        sd = 0.0
        mt = -float("inf")
        st = 0.0
        best = -float("inf")
        best_i = 0
        for start in range(0, V, BLOCK):
            idx = start + offs
            inside = idx < V
            x = (tl.load(zl_ptr + off + idx, mask=inside, other=-float("inf")).to(tl.float32)
                 + tl.load(zm_ptr + off + idx, mask=inside, other=0.0).to(tl.float32))
            y = tl.load(zt_ptr + off + idx, mask=inside, other=-float("inf")).to(tl.float32)
            bm = tl.max(x, 0)
            bi = tl.argmax(x, 0)
            best_i = tl.where(bm > best, start + bi, best_i)
            best = tl.maximum(best, bm)
            m_new = tl.maximum(md, bm)
            sd = sd * tl.exp(md - m_new) + tl.sum(tl.exp(x - m_new), 0)
            md = m_new
            m_new = tl.maximum(mt, tl.max(y, 0))
            st = st * tl.exp(mt - m_new) + tl.sum(tl.exp(y - m_new), 0)
            mt = m_new
        lse_d = md + tl.log(sd)
        lse_t = mt + tl.log(st)
        # The L1 distance and <p, s> need both normalisers: a second sweep.
        l1 = 0.0
        ps = 0.0
        for start in range(0, V, BLOCK):
            idx = start + offs
            inside = idx < V
            x = (tl.load(zl_ptr + off + idx, mask=inside, other=-float("inf")).to(tl.float32)
                 + tl.load(zm_ptr + off + idx, mask=inside, other=0.0).to(tl.float32))
            y = tl.load(zt_ptr + off + idx, mask=inside, other=-float("inf")).to(tl.float32)
            p = tl.exp(x - lse_d)
            diff = p - tl.exp(y - lse_t)  # 0 outside the vocabulary
            sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
            l1 += tl.sum(tl.abs(diff), 0)
            ps += tl.sum(p * sign, 0)
        label = tl.load(labels_ptr + row)
        z_label = (tl.load(zl_ptr + off + label).to(tl.float32)
                   + tl.load(zm_ptr + off + label).to(tl.float32))
        tl.store(ce_ptr + row, lse_d - z_label)
        tl.store(l1_ptr + row, l1)
        tl.store(arg_ptr + row, best_i.to(tl.int64))
        if WRITE_GRAD:
            a = tl.load(a_ptr + row)
            b = tl.load(b_ptr + row)
            for start in range(0, V, BLOCK):
                idx = start + offs
                inside = idx < V
                x = (tl.load(zl_ptr + off + idx, mask=inside, other=-float("inf")).to(tl.float32)
                     + tl.load(zm_ptr + off + idx, mask=inside, other=0.0).to(tl.float32))
                y = tl.load(zt_ptr + off + idx, mask=inside, other=-float("inf")).to(tl.float32)
                p = tl.exp(x - lse_d)
                diff = p - tl.exp(y - lse_t)
                sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
                g = p * ((sign - ps) * b + a) - tl.where(idx == label, a, 0.0)
                tl.store(zt_ptr + off + idx, g.to(zt_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)

    @triton.jit
    def unary_rows(z_ptr, stride, labels_ptr, coef_ptr, ce_ptr, arg_ptr, lse_ptr, V, mult, cap,
                   BLOCK: tl.constexpr, SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr):
        """DFlash2's ce_rows: per row, on the unary logits u = softcap(mult * z) (SOFTCAP:
        cap * tanh(mult * z / cap), else mult * z), the CE, the argmax and logsumexp(u); with
        WRITE_GRAD z becomes coef * (softmax(u) - onehot(label)) * du/dz. tanh from exp (the
        stable form: the sign times (1 - e) / (1 + e), e = exp(-2|v|))."""
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        offs = tl.arange(0, BLOCK)
        m = -float("inf")
        s = 0.0
        best = -float("inf")
        best_i = 0
        for start in range(0, V, BLOCK):
            idx = start + offs
            inside = idx < V
            u = tl.load(base + idx, mask=inside, other=0.0).to(tl.float32) * mult
            if SOFTCAP:
                v = u / cap
                e = tl.exp(-2.0 * tl.abs(v))
                t = (1.0 - e) / (1.0 + e)
                u = cap * tl.where(v < 0, -t, t)
            u = tl.where(inside, u, -float("inf"))
            bm = tl.max(u, 0)
            bi = tl.argmax(u, 0)
            best_i = tl.where(bm > best, start + bi, best_i)
            best = tl.maximum(best, bm)
            m_new = tl.maximum(m, bm)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(u - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        label = tl.load(labels_ptr + row)
        ul = tl.load(base + label).to(tl.float32) * mult
        if SOFTCAP:
            # Scalars of their own names: Triton refuses a name that is a scalar here and a
            # block in the gradient loop below (a loop-carried type change).
            vl = ul / cap
            el = tl.exp(-2.0 * tl.abs(vl))
            th = (1.0 - el) / (1.0 + el)
            ul = cap * tl.where(vl < 0, -th, th)
        tl.store(ce_ptr + row, lse - ul)
        tl.store(arg_ptr + row, best_i.to(tl.int64))
        tl.store(lse_ptr + row, lse)
        if WRITE_GRAD:
            a = tl.load(coef_ptr + row)
            for start in range(0, V, BLOCK):
                idx = start + offs
                inside = idx < V
                u = tl.load(base + idx, mask=inside, other=0.0).to(tl.float32) * mult
                slope = mult
                if SOFTCAP:
                    v = u / cap
                    e = tl.exp(-2.0 * tl.abs(v))
                    t = (1.0 - e) / (1.0 + e)
                    t = tl.where(v < 0, -t, t)
                    u = cap * t
                    slope = mult * (1.0 - t * t)
                g = a * (tl.exp(u - lse) - tl.where(idx == label, 1.0, 0.0)) * slope
                tl.store(base + idx, g.to(z_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)

    return SimpleNamespace(ce_rows=ce_rows, spark_rows=spark_rows, unary_rows=unary_rows)


def on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's. (Triton's interpreter,
    TRITON_INTERPRET=1, runs the kernels on CPU tensors: nothing to select there.)"""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def ce_rows(z: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor | None, ce: torch.Tensor,
            preds: torch.Tensor, write_grad: bool) -> None:
    """Fill ce [m] (float32) and preds [m] (int64) from the logits z [m, V]; with
    ``write_grad`` overwrite z with coef[:, None] * (softmax(z) - onehot(labels))."""
    m, V = z.shape
    if m == 0:
        return
    k = kernels()
    coef = ce if coef is None else coef  # read only with write_grad
    with on_device(z):
        k.ce_rows[(m,)](z, z.stride(0), labels, coef, ce, preds, V, BLOCK=block_for(V),
                        WRITE_GRAD=write_grad, num_warps=NUM_WARPS)


def spark_rows(zl: torch.Tensor, zm: torch.Tensor, zt: torch.Tensor, labels: torch.Tensor,
               a: torch.Tensor | None, b: torch.Tensor | None, ce: torch.Tensor,
               l1: torch.Tensor, preds: torch.Tensor, write_grad: bool) -> None:
    """Fill ce, l1 [m] (float32) and preds [m] from the drafter's logits zl + zm and the
    target's zt (each [m, V], one layout); with ``write_grad`` overwrite zt with the gradient of
    a * CE + b * L1 with respect to the drafter's logits."""
    m, V = zl.shape
    if m == 0:
        return
    assert zm.shape == zt.shape == zl.shape and zm.stride() == zt.stride() == zl.stride()
    k = kernels()
    a = ce if a is None else a
    b = ce if b is None else b
    with on_device(zl):
        k.spark_rows[(m,)](zl, zm, zt, zl.stride(0), labels, a, b, ce, l1, preds, V,
                           BLOCK=block_for(V), WRITE_GRAD=write_grad, num_warps=NUM_WARPS)


def unary_rows(z: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor | None,
               ce: torch.Tensor, preds: torch.Tensor, lse: torch.Tensor, multiplier: float,
               softcap: float, write_grad: bool) -> None:
    """DFlash2's rows: fill ce, lse [m] (float32) and preds [m] from the logits z [m, V] read as
    unary logits u = softcap(multiplier * z) (softcap <= 0: none); with ``write_grad``
    overwrite z with coef[:, None] * (softmax(u) - onehot(labels)) * du/dz."""
    m, V = z.shape
    if m == 0:
        return
    k = kernels()
    coef = ce if coef is None else coef
    with on_device(z):
        k.unary_rows[(m,)](z, z.stride(0), labels, coef, ce, preds, lse, V, float(multiplier),
                           float(softcap) if softcap > 0 else 1.0, BLOCK=block_for(V),
                           SOFTCAP=softcap > 0, WRITE_GRAD=write_grad, num_warps=NUM_WARPS)
