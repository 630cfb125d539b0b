"""DFlash2's fused loss (models/fused_loss/selector_rows.py) on the CPU, where its row kernel is
the torch twin of the Triton one: the loss, its three terms, both taus and every gradient (the
drafter's states, the gate's weight, both codebooks) equal the torch path's (models/dflash2/loss,
the reference), for both label choices, with the multiplier and the softcap, over chunk edges,
in float32 and with a bf16 lm_head; the twin itself against plain autograd; and no rows x
vocabulary tensor beyond one chunk's. The Triton kernel is tests/gpu/test_fused_loss_gpu.py's."""

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dflash_core.models import objective as obj
from dflash_core.models.dflash2.loss import dflash2_loss, predecessors
from dflash_core.models.dflash2.selector import unary
from dflash_core.models.fused_loss import selector_rows as sr

from ..dflash2.test_loss import batch, drafter_and_hidden, plant_hits
from ..dflash2.tiny import B, H, SETTINGS, V

GAMMA = 4.0


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def both(m, hidden, labels, prev, chunk, inject, alpha=0.7):
    """(out, grads) of the torch path, then of the fused one, from the same start."""
    sel = m.candidate_selector
    params = [sel.hidden_projection.weight, sel.predecessor_codebook, sel.successor_codebook]
    res = []
    for fused in (False, True):
        h = hidden.clone().requires_grad_()
        for p in params:
            p.grad = None
        out = dflash2_loss(h, labels, prev, m, gamma=GAMMA, alpha=alpha, inject=inject,
                           chunk=chunk, fused=fused)
        (out.loss * out.weight_sum).backward()
        res.append((out, [h.grad] + [p.grad.clone() for p in params]))
    return res


def setup(seed, head_dtype=torch.float32, multiplier=1.0, softcap=0.0, settings=SETTINGS):
    m = drafter_and_hidden(seed, settings=settings)
    m.output_multiplier, m.softcap = multiplier, softcap
    lm = m.lm_head
    lm.weight.data = lm.weight.data.to(head_dtype)
    ids, anchors, labels = batch(seed)
    prev = predecessors(ids, anchors, B)
    hidden = torch.randn(2, 3 * B, H, generator=torch.Generator().manual_seed(seed))
    labels = plant_hits(m, hidden.to(head_dtype), labels)
    return m, hidden, labels, prev


WIDE = replace(SETTINGS, selector_rank=64)  # K x r above V: the torch path's other product


@pytest.mark.parametrize("inject", [False, True], ids=["drop", "inject"])
@pytest.mark.parametrize("unary_map", [(1.0, 0.0), (0.5, 3.0)], ids=["plain", "softcap"])
@pytest.mark.parametrize("settings", [SETTINGS, WIDE], ids=["gather", "wide"])
def test_the_fused_rows_equal_the_torch_path(inject, unary_map, settings):
    m, hidden, labels, prev = setup(0, multiplier=unary_map[0], softcap=unary_map[1],
                                    settings=settings)
    N = int((labels != obj.IGNORE).sum())
    for chunk in (1, 7, N - 1, N, 4096):
        (ref, g_ref), (got, g_got) = both(m, hidden, labels, prev, chunk, inject)
        assert rel(got.loss, ref.loss) <= 1e-6, chunk
        assert rel(got.terms, ref.terms) <= 1e-6, (chunk, got.terms, ref.terms)
        assert got.weight_sum == ref.weight_sum and got.blocks == ref.blocks
        assert torch.equal(got.tau_sum, ref.tau_sum)
        assert torch.equal(got.unary_tau_sum, ref.unary_tau_sum)
        for name, a, b in zip(("hidden", "gate", "predecessor", "successor"), g_got, g_ref):
            assert b.abs().sum() > 0, name
            assert rel(a, b) <= 1e-5, (chunk, name, rel(a, b))
    hit = float(ref.terms[2]) / ref.weight_sum
    assert 0 < hit < 1  # labels in and out of the candidates: both branches ran


def test_with_a_bf16_lm_head_the_rounding_is_the_torch_paths():
    """The logits and their gradient in bf16, as the engine keeps the target's head: the same
    candidates (top-K of the same bf16 logits), the gradient rounded once, as autograd does."""
    m, hidden, labels, prev = setup(1, head_dtype=torch.bfloat16)
    for chunk in (5, 4096):
        (ref, g_ref), (got, g_got) = both(m, hidden, labels, prev, chunk, inject=False)
        assert rel(got.loss, ref.loss) <= 1e-5
        assert torch.equal(got.tau_sum, ref.tau_sum)
        for a, b in zip(g_got, g_ref):
            assert rel(a, b) <= 1e-3


def test_without_a_gradient_it_only_measures():
    m, hidden, labels, prev = setup(2)
    with torch.no_grad():
        ref = dflash2_loss(hidden, labels, prev, m, gamma=GAMMA, alpha=1.0, inject=False)
        got = dflash2_loss(hidden, labels, prev, m, gamma=GAMMA, alpha=1.0, inject=False,
                           fused=True)
    assert got.loss.grad_fn is None and rel(got.loss, ref.loss) <= 1e-6
    assert torch.equal(got.tau_sum, ref.tau_sum)


@pytest.mark.parametrize("softcap", [0.0, 2.5])
def test_the_row_twin_is_autograd_of_the_unary_cross_entropy(softcap):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(6, 40, generator=g) * 3
    labels = torch.randint(0, 40, (6,), generator=g)
    coef = torch.rand(6, generator=g)
    leaf = z.clone().requires_grad_()
    u = unary(leaf, 0.7, softcap)
    ce_ref = torch.logsumexp(u, -1) - u.gather(1, labels[:, None]).squeeze(1)
    (coef * ce_ref).sum().backward()
    buf = z.clone()
    ce, lse = torch.empty(6), torch.empty(6)
    preds = torch.empty(6, dtype=torch.long)
    sr.unary_rows_torch(buf, labels, coef, ce, preds, lse, 0.7, softcap, True)
    assert torch.allclose(ce, ce_ref.detach(), atol=1e-6)
    assert torch.equal(preds, u.argmax(-1)) and torch.allclose(lse, torch.logsumexp(u, -1))
    assert torch.allclose(buf, leaf.grad, atol=1e-6)


class VocabularyRows(TorchDispatchMode):
    """The most rows of any tensor with the vocabulary as its last dimension that an op (forward
    or backward) made while active (views of the lm_head aside)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                 if isinstance(a, torch.Tensor)}
        for x in tree_flatten(out)[0]:
            if (isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-1] == V
                    and x.untyped_storage().data_ptr() not in given):  # made, not a view
                self.most = max(self.most, x.numel() // V)
        return out


def test_no_rows_by_vocabulary_tensor_beyond_one_chunk():
    m, hidden, labels, prev = setup(4)
    N, chunk = int((labels != obj.IGNORE).sum()), 4
    assert N > 3 * chunk
    saved = []

    def pack(x):
        saved.append(x.numel())
        return x

    h = hidden.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = dflash2_loss(h, labels, prev, m, gamma=GAMMA, alpha=1.0, inject=False,
                           chunk=chunk, fused=True)
    assert max(saved, default=0) < chunk * V  # nothing vocabulary-wide kept for backward
    for rows in (chunk, N):  # the measure can fail: one chunk of all N rows shows as N
        mode = VocabularyRows()
        h.grad = None
        with mode:
            out = dflash2_loss(h, labels, prev, m, gamma=GAMMA, alpha=1.0, inject=False,
                               chunk=rows, fused=True)
            (out.loss * out.weight_sum).backward()
        assert h.grad.abs().sum() > 0
        assert mode.most == rows, (rows, mode.most)
