"""DSpark's loss: the chunked, recomputed loss equals a plain dense one (values and gradients),
never makes a rows x vocabulary tensor, and reads the right labels, Markov inputs and target
states for each block slot."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dflash_core.models.dspark import loss as dl
from dflash_core.models.dspark.heads import ConfidenceHead, MarkovHead
from dflash_core.models.objective import IGNORE

V, H, R = 300, 16, 4


def heads(dtype, seed=0):
    torch.manual_seed(seed)
    mk, cf = MarkovHead(V, R).to(dtype), ConfidenceHead(H + R).to(dtype)
    with torch.no_grad():
        mk.markov_w1.weight.normal_(0, 1.0)
        mk.markov_w2.weight.normal_(0, 0.5)
        cf.proj.weight.normal_(0, 0.3)
        cf.proj.bias.fill_(0.2)
    return mk, cf


def rows(N, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=dtype)
    t = torch.randn(N, H, generator=g, dtype=dtype)
    W = torch.randn(V, H, generator=g, dtype=dtype) * 0.5
    prev = torch.randint(0, V, (N,), generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    weights = torch.exp(-torch.randint(0, 7, (N,), generator=g).float() / 4.0).to(dtype)
    return h, t, W, prev, labels, weights


def plain_sums(h, t, W, prev, labels, weights, w1, w2, cw, cb):
    """The loss as written: whole rows x vocabulary tensors."""
    e = w1[prev]
    logits = h @ W.T + e @ w2.T
    p_d = torch.softmax(logits, -1)
    p_t = torch.softmax(t @ W.T, -1)
    ce = -torch.log_softmax(logits, -1)[torch.arange(len(labels)), labels]
    tv = (p_d - p_t).abs().sum(-1)
    c_star = (1 - 0.5 * tv).clamp(0, 1).detach()
    c_logit = torch.cat([h, e], -1) @ cw.T + cb
    bce = F.binary_cross_entropy_with_logits(c_logit.squeeze(-1), c_star, reduction="none")
    return torch.stack([(weights * ce).sum(), (weights * tv).sum(), (weights * bce).sum()])


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_chunked_terms_and_gradients_equal_the_plain_loss(dtype, tol, chunk):
    N = 50
    mk, cf = heads(dtype)
    h, t, W, prev, labels, weights = rows(N, dtype)
    coef = torch.tensor([0.1, 0.9, 1.0], dtype=dtype)

    h1 = h.clone().requires_grad_()
    got = dl.row_terms(h1, t, prev, labels, weights, W, mk, cf, chunk)
    (coef * got.sums).sum().backward()
    params = [mk.markov_w1.weight, mk.markov_w2.weight, cf.proj.weight, cf.proj.bias]
    g_got = [h1.grad] + [p.grad.clone() for p in params]

    h2 = h.clone().requires_grad_()
    ps = [p.detach().clone().requires_grad_() for p in params]
    want = plain_sums(h2, t, W, prev, labels, weights, *ps)
    (coef * want).sum().backward()
    g_want = [h2.grad] + [p.grad for p in ps]

    torch.testing.assert_close(got.sums, want.detach(), rtol=tol, atol=tol)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    # The terms are not degenerate: the distributions differ, the BCE has a gradient.
    assert want[1] > 0.1 * weights.sum() and cf.proj.weight.grad.abs().sum() > 0
    logits = h @ W.T + mk.markov_w1.weight[prev].detach() @ mk.markov_w2.weight.detach().T
    assert torch.equal(got.preds, logits.argmax(-1))


def test_without_a_confidence_head_the_bce_term_is_zero():
    mk, _ = heads(torch.float64)
    h, t, W, prev, labels, weights = rows(9, torch.float64)
    out = dl.row_terms(h, t, prev, labels, weights, W, mk, None, 4)
    assert out.sums[2] == 0 and out.sums[0] > 0


class LargestTensor(TorchDispatchMode):
    """The most elements any op (forward or backward) produced while active."""

    def __init__(self):
        super().__init__()
        self.most, self.ops = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                self.most = max(self.most, x.numel())
        return out


def _peak(fn):
    mode = LargestTensor()
    with mode:
        fn()
    return mode


def test_no_tensor_of_all_rows_by_the_vocabulary_ever_exists():
    N, chunk = 256, 32  # N*V = 76800 elements; a chunk's 9600; weights (V*H) 4800
    mk, cf = heads(torch.float32)
    h, t, W, prev, labels, weights = rows(N, torch.float32)
    h = h.requires_grad_()

    def chunked():
        dl.row_terms(h, t, prev, labels, weights, W, mk, cf, chunk).sums.sum().backward()

    def plain():
        plain_sums(h, t, W, prev, labels, weights, mk.markov_w1.weight, mk.markov_w2.weight,
                   cf.proj.weight, cf.proj.bias).sum().backward()

    seen = _peak(chunked)
    assert any("mm" in op for op in seen.ops) and any("embedding_dense_backward" in op
                                                      for op in seen.ops), seen.ops
    assert seen.most <= chunk * V, f"an op made {seen.most} elements, a chunk is {chunk * V}"
    # The measure can fail: the plain loss makes whole rows x vocabulary tensors.
    assert _peak(plain).most >= N * V

    saved = []

    def pack(x):
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        dl.row_terms(h, t, prev, labels, weights, W, mk, cf, chunk).sums.sum()
    assert saved and max(saved) < chunk * V, max(saved)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        plain_sums(h, t, W, prev, labels, weights, mk.markov_w1.weight, mk.markov_w2.weight,
                   cf.proj.weight, cf.proj.bias)
    assert max(saved) >= N * V


# ------------------------------------------------------------------------------------------------
# Blocks: labels, Markov inputs, target positions, slot mask and weights
# ------------------------------------------------------------------------------------------------

class Head:
    """What dspark_loss reads of a drafter."""

    def __init__(self, W, mk, cf):
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        self.lm_head.weight = torch.nn.Parameter(W, requires_grad=False)
        self.markov_head, self.confidence_head = mk, cf


def _blocks(dtype):
    g = torch.Generator().manual_seed(3)
    L, B = 20, 5
    ids = torch.randint(0, V, (2, L), generator=g)
    mask = torch.ones(2, L, dtype=torch.long)
    mask[0, :4] = 0
    mask[0, 12] = 0  # a later turn: blocks reaching it stop there
    mask[1, 17:] = 0
    anchors = torch.tensor([[4, 9, 14, -1], [0, 3, 13, 15]])
    A = anchors.shape[1]
    hidden = torch.randn(2, A * B, H, generator=g, dtype=dtype)
    last = torch.randn(2, L, H, generator=g, dtype=dtype)
    return ids, mask, anchors, hidden, last, B


def test_block_labels_and_markov_inputs_follow_anchor_as_first():
    ids, mask, anchors, _, _, B = _blocks(torch.float64)
    labels, prev = dl.dspark_targets(dl.wide_labels(ids, mask, anchors, B),
                                     dl.anchor_tokens(ids, anchors))
    n, A, L = ids.shape[0], anchors.shape[1], ids.shape[1]
    for i in range(n):
        for a in range(A):
            p = int(anchors[i, a])
            alive = p >= 0
            for j in range(B):
                at = p + j + 1
                alive = alive and at < L and bool(mask[i, at])
                assert int(labels[i, a, j]) == (int(ids[i, at]) if alive else IGNORE)
                if alive:  # slot 0 gets the anchor, slot j the token at anchor+j
                    assert int(prev[i, a, j]) == int(ids[i, p + j])
    # the cut by the loss mask (position 12) and by the end (L = 20) both show
    assert (labels[0, 1] != IGNORE).tolist() == [True, True, False, False, False]
    assert (labels[1, 3] != IGNORE).tolist() == [True, False, False, False, False]
    assert (labels[0, 3] == IGNORE).all()


def test_block_loss_equals_a_plain_loop_over_slots():
    dtype = torch.float64
    ids, mask, anchors, hidden, last, B = _blocks(dtype)
    mk, cf = heads(dtype)
    W = torch.randn(V, H, generator=torch.Generator().manual_seed(5), dtype=dtype) * 0.5
    labels, prev = dl.dspark_targets(dl.wide_labels(ids, mask, anchors, B),
                                     dl.anchor_tokens(ids, anchors))
    pos = (anchors.clamp(min=0)[:, :, None] + torch.arange(B)).reshape(2, -1)
    hid = hidden.clone().requires_grad_()
    out = dl.dspark_loss(hid, last, pos, labels, prev, Head(W, mk, cf), gamma=4.0,
                         loss_weights=(0.1, 0.9, 1.0), chunk=3)
    out.loss.backward()

    hid2 = hidden.clone().requires_grad_()
    sums, wsum, L = torch.zeros(3, dtype=dtype), 0.0, ids.shape[1]
    for i in range(2):
        for a in range(anchors.shape[1]):
            p = int(anchors[i, a])
            for j in range(B):
                at = p + j + 1
                if p < 0 or at >= L or not all(mask[i, p + 1: at + 1]):
                    break
                w = math.exp(-j / 4.0)
                sums += plain_sums(hid2[i, a * B + j][None], last[i, p + j][None], W,
                                   ids[i, p + j][None], ids[i, at][None],
                                   torch.tensor([w], dtype=dtype), mk.markov_w1.weight,
                                   mk.markov_w2.weight, cf.proj.weight, cf.proj.bias)
                wsum += w
    want = (torch.tensor([0.1, 0.9, 1.0], dtype=dtype) * sums).sum() / wsum
    want.backward()
    # the slot weights are float32 (as in training): agreement to their rounding
    assert out.weight_sum == pytest.approx(wsum, rel=1e-6)
    torch.testing.assert_close(out.loss.detach(), want.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(out.terms, sums.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(hid.grad, hid2.grad, rtol=1e-6, atol=1e-9)
    means = out.term_means()
    assert set(means) == {"ce", "tv", "conf"} and means["tv"] > 0
    assert out.blocks == 7  # every block but the padding one has slot 0 labelled


def test_teacher_forced_tau_of_a_perfect_predictor_is_block_size_plus_one():
    labels = torch.tensor([[[5, 6, 7], [8, IGNORE, IGNORE], [IGNORE] * 3]])
    assert float(dl.tau_sum(labels.clone(), labels)) == (3 + 1) + (1 + 1)
    wrong = labels.clone()
    wrong[0, 0, 1] = 0  # slot 1 wrong: the prefix stops at 1
    assert float(dl.tau_sum(wrong, labels)) == (1 + 1) + (1 + 1)


def test_slot_weights_start_at_one_on_slot_zero():
    w = dl.slot_weights(7, 4.0)
    assert w[0] == 1.0 and torch.allclose(w, torch.exp(-torch.arange(7.0) / 4.0))
