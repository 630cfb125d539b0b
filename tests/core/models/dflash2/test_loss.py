"""DFlash2's objective: DFlash's loss + alpha x the selector's K-way cross-entropy over the
draft's own top-K with the previous token teacher-forced, against a dense reference written from
the formula, for both label choices; alpha 0 is DFlash's loss; chunking changes nothing; the
step's tau is the selector's."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from dflash_core.models import objective as obj
from dflash_core.models.dflash2.loss import dflash2_loss, predecessors
from dflash_core.models.objective import IGNORE

from .tiny import B, H, K, SETTINGS, V, dflash2, head

GAMMA = 4.0


def batch(seed=0, n=2, A=3, L=30):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (n, L), generator=g)
    mask = torch.ones(n, L, dtype=torch.long)
    mask[0, :4] = 0
    mask[1, 20:23] = 0  # a hole: slots with a label after an unlabelled one
    anchors = torch.tensor([[4, 9, 26], [2, 17, -1]])[:, :A]
    labels = obj.block_labels(ids, mask, anchors, B)
    return ids, anchors, labels


def plant_hits(m, hidden, labels):
    """Every other labelled slot's label made its third unary candidate (random states would
    leave every label outside a top-5 of 300)."""
    with torch.no_grad():
        third = m.lm_head(hidden).topk(3).indices[..., 2].view(labels.shape)
    out = labels.clone()
    flat, src = out.view(-1), third.reshape(-1)
    rows = torch.nonzero(flat != IGNORE).squeeze(1)[::2]
    flat[rows] = src[rows]
    return out


def drafter_and_hidden(seed=0, settings=SETTINGS):
    m = dflash2(seed=seed, std=0.3, settings=settings)
    m.attach_target_head(*head())
    return m


def reference(m, hidden, labels, prev, alpha, inject):
    """Row by row from the formula: u = lm_head(h); CE = -log softmax(u)[y]; C = top-K(u);
    S(b) = u[b] + sum_j A[prev, j] (W_h h)_j B[b, j]; SEL = -log softmax_C(S)[y] when y in C
    (inject: y takes C's last place); (sum w CE + alpha sum w SEL) / sum w."""
    sel = m.candidate_selector
    n, A, Bk = labels.shape
    w = obj.slot_weights(Bk, GAMMA)
    num = den = 0.0
    h = hidden.view(n, A, Bk, -1)
    for i in range(n):
        for a in range(A):
            for k in range(Bk):
                y = int(labels[i, a, k])
                if y == IGNORE:
                    continue
                u = m.lm_head(h[i, a, k])
                ce = -F.log_softmax(u, -1)[y]
                cand = u.detach().topk(K).indices.tolist()
                if y not in cand and inject:
                    cand[-1] = y
                term = 0.0
                if y in cand:
                    gate = sel.hidden_projection.weight @ h[i, a, k]
                    pa = sel.predecessor_codebook[int(prev[i, a, k])]
                    s = torch.stack([u[b] + (pa * gate * sel.successor_codebook[b]).sum()
                                     for b in cand])
                    term = -F.log_softmax(s, -1)[cand.index(y)]
                num = num + w[k] * (ce + alpha * term)
                den += float(w[k])
    return num / den


# K x r above the vocabulary (the demo's shape) takes the pair term as one product over the
# vocabulary, below it gathers K codebook rows per slot: both are checked
WIDE = replace(SETTINGS, selector_rank=64)


@pytest.mark.parametrize("inject, settings", [(False, SETTINGS), (True, SETTINGS),
                                              (False, WIDE), (True, WIDE)])
def test_equals_the_formula_and_its_gradient(inject, settings):
    assert (settings.selector_top_k * settings.selector_rank > V) == (settings is WIDE)
    m = drafter_and_hidden(settings=settings)
    ids, anchors, labels = batch()
    prev = predecessors(ids, anchors, B)
    hidden = torch.randn(2, 3 * B, H, requires_grad=True)
    labels = plant_hits(m, hidden, labels)
    got = dflash2_loss(hidden, labels, prev, m, gamma=GAMMA, alpha=0.7, inject=inject, chunk=5)
    want = reference(m, hidden, labels, prev, 0.7, inject)
    assert got.loss.item() == pytest.approx(want.item(), rel=1e-5)
    params = [hidden, m.candidate_selector.successor_codebook,
              m.candidate_selector.predecessor_codebook,
              m.candidate_selector.hidden_projection.weight]
    g1 = torch.autograd.grad(got.loss, params)
    g2 = torch.autograd.grad(want, params)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-5) and a.abs().sum() > 0
    hit = got.terms[2].item() / got.weight_sum
    assert 0 < hit < 1  # some labels are among the K candidates, some not: both paths run


def test_the_two_label_choices_differ_only_where_the_label_is_missing():
    m = drafter_and_hidden(1)
    ids, anchors, labels = batch(1)
    prev = predecessors(ids, anchors, B)
    hidden = torch.randn(2, 3 * B, H)
    labels = plant_hits(m, hidden, labels)
    drop = dflash2_loss(hidden, labels, prev, m, gamma=GAMMA, alpha=1.0, inject=False)
    inject = dflash2_loss(hidden, labels, prev, m, gamma=GAMMA, alpha=1.0, inject=True)
    assert torch.equal(drop.terms[[0, 2]], inject.terms[[0, 2]])
    assert inject.terms[1] > drop.terms[1]


def test_alpha_zero_is_dflash_loss_and_chunks_change_nothing():
    m = drafter_and_hidden(2)
    ids, anchors, labels = batch(2)
    prev = predecessors(ids, anchors, B)
    hidden = torch.randn(2, 3 * B, H)
    base = obj.chunked_loss(hidden, labels, m.lm_head.weight, GAMMA)
    one = dflash2_loss(hidden, labels, prev, m, gamma=GAMMA, alpha=0.0, inject=False, chunk=3)
    many = dflash2_loss(hidden, labels, prev, m, gamma=GAMMA, alpha=0.0, inject=False,
                        chunk=1000)
    assert one.loss.item() == pytest.approx(base.loss.item(), rel=1e-5)
    assert torch.allclose(one.terms, many.terms, rtol=1e-5)
    assert float(one.unary_tau_sum) == float(base.tau_sum)  # the unary argmax is DFlash's


def test_predecessors_are_the_tokens_before_each_slot():
    ids = torch.arange(100, 130)[None]
    prev = predecessors(ids, torch.tensor([[4, 20]]), B)
    assert prev[0, 0, 1:].tolist() == list(range(104, 104 + B - 1))  # slot 1: the anchor's
    assert prev[0, 1, 1].item() == 120


def test_step_tau_follows_the_selector():
    """Labels equal to the selector's own teacher-forced choices (from the formula) give every
    block its full length along the selector's path; the unary argmax, which the pair term
    overrules here, falls short."""
    m = drafter_and_hidden(3)
    with torch.no_grad():
        m.candidate_selector.successor_codebook.mul_(30)  # a pair term that changes choices
    ids, anchors, _ = batch(3)
    L = ids.shape[1]
    hidden = torch.randn(2, 3 * B, H)
    h = hidden.view(2, 3, B, H)
    sel = m.candidate_selector
    # Walk each block with teacher forcing: the label of slot k is the selector's choice given
    # the token before it, which is the anchor or the label of slot k-1.
    for i in range(2):
        for a in range(3):
            s0 = int(anchors[i, a])
            if s0 < 0:
                continue
            for k in range(1, B):
                if s0 + k >= L:
                    break
                with torch.no_grad():
                    u = m.lm_head(h[i, a, k])
                    cand = u.topk(K).indices
                    gate = sel.hidden_projection.weight @ h[i, a, k]
                    pa = sel.predecessor_codebook[ids[i, s0 + k - 1]]
                    score = u[cand] + (sel.successor_codebook[cand] * (pa * gate)).sum(-1)
                ids[i, s0 + k] = cand[score.argmax()]
    labels = obj.block_labels(ids, torch.ones_like(ids), anchors, B)
    out = dflash2_loss(hidden, labels, predecessors(ids, anchors, B), m, gamma=GAMMA, alpha=1.0,
                       inject=False)
    full = ((labels[..., 1:] != IGNORE).sum(-1) + 1)[labels[..., 1] != IGNORE]
    assert float(out.tau_sum) == float(full.sum())
    assert float(out.unary_tau_sum) < float(out.tau_sum)
