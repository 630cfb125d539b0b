"""The training objective of docs/algorithm.md, checked piece by piece."""

import math

import numpy as np
import pytest
import torch

from dflash_core.models import objective as obj
from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
from tests.core.models.dflash.test_drafter import tiny_target_config


def test_anchors_are_valid_distinct_and_reseeded_per_epoch():
    mask = np.zeros(200, dtype=np.uint8)
    mask[50:120] = 1
    mask[150:199] = 1
    valid = set(obj.valid_anchor_positions(mask).tolist())
    assert min(valid) == 50 and 119 not in valid and 118 in valid and 198 not in valid
    a0 = obj.sample_anchors(mask, 32, obj.anchor_rng(7, 0, 3))
    a0_again = obj.sample_anchors(mask, 32, obj.anchor_rng(7, 0, 3))
    a1 = obj.sample_anchors(mask, 32, obj.anchor_rng(7, 1, 3))
    assert len(a0) == 32 and len(set(a0.tolist())) == 32
    assert set(a0.tolist()) <= valid
    assert np.array_equal(a0, a0_again)
    assert not np.array_equal(a0, a1)
    # Fewer valid positions than anchors: take them all.
    assert len(obj.sample_anchors(mask, 10_000, obj.anchor_rng(0, 0, 0))) == len(valid)


def test_labels_are_unshifted_and_masked():
    ids = torch.arange(100, 120)[None]
    mask = torch.ones(1, 20, dtype=torch.long)
    mask[0, 15] = 0
    labels = obj.block_labels(ids, mask, torch.tensor([[2, 12, -1]]), 4)
    assert labels[0, 0].tolist() == [obj.IGNORE, 103, 104, 105]
    assert labels[0, 1].tolist() == [obj.IGNORE, 113, 114, obj.IGNORE]  # 15 outside loss mask
    assert labels[0, 2].tolist() == [obj.IGNORE] * 4  # padding block
    end = obj.block_labels(ids, mask, torch.tensor([[18]]), 4)
    assert end[0, 0].tolist() == [obj.IGNORE, 119, obj.IGNORE, obj.IGNORE]  # past the end


@pytest.mark.parametrize("B,gamma", [(16, 7.0), (8, 4.0)])
def test_weights_match_formula(B, gamma):
    w = obj.slot_weights(B, gamma)
    assert w[0] == 0
    for k in range(1, B):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / gamma), rel_tol=1e-6)


def test_chunked_loss_equals_unchunked_loss_and_gradient():
    torch.manual_seed(0)
    n, A, B, H, V = 2, 6, 8, 16, 50
    hidden = torch.randn(n, A * B, H, requires_grad=True)
    weight = torch.randn(V, H)
    labels = torch.randint(0, V, (n, A, B))
    labels[:, :, 0] = obj.IGNORE
    labels[1, 4:] = obj.IGNORE
    labels[0, 2, 5:] = obj.IGNORE
    out = obj.chunked_loss(hidden, labels, weight, gamma=4.0, chunk=7)
    out.loss.backward()
    g_chunked = hidden.grad.clone()
    hidden.grad = None
    ref = obj.dense_reference_loss(hidden, labels, weight, gamma=4.0)
    ref.backward()
    assert torch.allclose(out.loss, ref, atol=1e-5)
    assert torch.allclose(g_chunked, hidden.grad, atol=1e-6)


def test_tau_of_perfect_predictor_is_block_size():
    labels = torch.randint(0, 10, (2, 3, 16))
    labels[:, :, 0] = obj.IGNORE
    tau, blocks = obj.teacher_forced_tau(labels.clone(), labels)
    assert tau == 16 and blocks == 6
    wrong_first = labels.clone()
    wrong_first[:, :, 1] += 1
    assert obj.teacher_forced_tau(wrong_first, labels)[0] == 1
    half = labels.clone()
    half[:, :, 5] += 1  # slots 1..4 right
    assert obj.teacher_forced_tau(half, labels)[0] == 5


def _drafter():
    cfg = build_drafter_config(tiny_target_config(), num_layers=2, target_layer_ids=[1, 3, 5],
                               block_size=4, mask_token_id=299)
    torch.manual_seed(0)
    return DFlashDrafter(cfg).eval()


@pytest.mark.parametrize("impl", ["chunked", "flex"])
def test_block_sees_only_context_before_its_anchor(impl):
    m = _drafter()
    m.attn_impl = impl
    S, B = 24, 4
    anchors = torch.tensor([[5, 12, 18]])
    ctx = torch.randn(1, S, 192)
    emb = torch.randn(1, 3 * B, 64)
    pos = (anchors[0, :, None] + torch.arange(B)).view(1, -1)
    with torch.no_grad():
        base = m(ctx, emb, pos, anchors).view(3, B, -1)
        at_anchor = ctx.clone()
        at_anchor[0, 12:] += 5.0  # the anchor's own feature and everything after it
        moved = m(at_anchor, emb, pos, anchors).view(3, B, -1)
        before = ctx.clone()
        before[0, 11] += 5.0  # just before the second anchor
        moved_before = m(before, emb, pos, anchors).view(3, B, -1)
    assert torch.equal(base[0], moved[0]) and torch.equal(base[1], moved[1])
    assert not torch.allclose(base[2], moved[2])  # anchor 18 sees positions 12..17
    assert torch.equal(base[0], moved_before[0])
    assert not torch.allclose(base[1], moved_before[1])
    assert not torch.allclose(base[2], moved_before[2])


def test_lr_schedule_warms_up_then_decays():
    lrs = [obj.lr_at(s, 100, 1.0, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] < 0.01


def test_batch_anchors_pad_to_a_multiple_without_new_anchors():
    masks = [np.ones(50, dtype=np.uint8), np.ones(20, dtype=np.uint8)]
    plain = obj.batch_anchors(masks, 100, 0, 0, [0, 1])
    padded = obj.batch_anchors(masks, 100, 0, 0, [0, 1], pad_to=16)
    assert plain.shape == (2, 49) and padded.shape == (2, 64)
    assert torch.equal(padded[:, :49], plain) and (padded[:, 49:] == -1).all()
    capped = obj.batch_anchors(masks, 50, 0, 0, [0, 1], pad_to=64)
    assert capped.shape == (2, 50)  # never wider than num_anchors needs


def test_sequences_per_group_bounds_the_block_tokens_of_one_pass():
    assert obj.sequences_per_group(65536, 512 * 16) == 8
    assert obj.sequences_per_group(16384, 512 * 16) == 2
    assert obj.sequences_per_group(8191, 512 * 16) == 1  # one sequence even if it is over
    assert obj.sequences_per_group(100, 0) == 100  # no block tokens: never divides by zero


def _gappy_labels(n=2, A=5, B=8, V=50, seed=0):
    """Labels with every kind of unlabelled slot: slot 0, a gap inside a block (another turn's
    tokens outside the loss mask), the end of the sequence, a padding block."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (n, A, B), generator=g)
    labels[:, :, 0] = obj.IGNORE
    labels[0, 1, 4] = obj.IGNORE  # a gap: slots 5.. are labelled again
    labels[0, 2, 6:] = obj.IGNORE  # past the end
    labels[1, 3] = obj.IGNORE  # a padding block
    return labels


def _brute_dpace_weights(ce_dense, labels, alpha):
    """w_j = sum over m >= j of prod over i <= m of q_i, over each block's valid prefix, by loops."""
    n, A, B = labels.shape
    w = torch.zeros(n, A, B)
    for r in range(n):
        for a in range(A):
            prefix = []
            for k in range(1, B):
                if labels[r, a, k] == obj.IGNORE:
                    break
                prefix.append(k)
            q = {k: (1 - alpha) * math.exp(-float(ce_dense[r, a, k])) + alpha for k in prefix}
            for j in prefix:
                w[r, a, j] = sum(math.prod(q[i] for i in prefix if i <= m)
                                 for m in prefix if m >= j)
    return w


@pytest.mark.parametrize("alpha", [0.5, 0.0, 1.0])
def test_dpace_weights_match_brute_force_over_the_valid_prefix(alpha):
    labels = _gappy_labels()
    ce_dense = torch.rand(labels.shape) * 4
    rows = obj.label_rows(labels, 7.0, dpace_alpha=alpha)
    # Only each block's valid prefix is read: not slot 0, not the gap, not what follows it.
    prefix = set(rows.rows.tolist())
    B = labels.shape[-1]
    block1 = {(1 * B) + k for k in range(B)}
    assert {(1 * B) + k for k in (1, 2, 3)} == prefix & block1
    assert rows.weights is None and rows.weight_sum is None
    got = obj.dpace_weights(ce_dense.reshape(-1)[rows.rows], rows.rows, labels.numel(), B, alpha)
    want = _brute_dpace_weights(ce_dense, labels, alpha).reshape(-1)
    assert torch.allclose(got, want[rows.rows], rtol=1e-5, atol=1e-6)
    assert float(want.sum()) == pytest.approx(float(got.sum()), rel=1e-5)  # nothing outside
    if alpha == 1.0:  # q = 1: w_j counts the prefix slots from j on
        assert got[:3].tolist() == [7.0, 6.0, 5.0]


def test_dpace_chunked_loss_is_the_dense_loss_with_detached_weights():
    torch.manual_seed(0)
    n, A, B, H, V = 2, 5, 8, 16, 50
    labels = _gappy_labels(n, A, B, V)
    hidden = torch.randn(n, A * B, H, requires_grad=True)
    weight = torch.randn(V, H) * 0.3
    out = obj.chunked_loss(hidden, labels, weight, gamma=4.0, chunk=7, dpace_alpha=0.5)
    out.loss.backward()
    g_chunked = hidden.grad.clone()
    hidden.grad = None
    # Dense: the whole logits at once, the weights by brute force, as constants.
    logits = torch.nn.functional.linear(hidden.reshape(n * A * B, H), weight)
    ce = torch.nn.functional.cross_entropy(logits, labels.reshape(-1).clamp(min=0),
                                           reduction="none")
    w = _brute_dpace_weights(ce.detach().view(n, A, B), labels, 0.5).reshape(-1)
    ref = (ce * w).sum() / w.sum()
    ref.backward()
    assert torch.allclose(out.loss, ref, atol=1e-5)
    assert float(out.weight_sum) == pytest.approx(float(w.sum()), rel=1e-5)
    # Gradients flow through the cross-entropies only: with weights that moved with hidden,
    # the gradient would differ.
    assert torch.allclose(g_chunked, hidden.grad, atol=1e-6)
    # Teacher-forced tau reads the same predictions as under the DFlash loss.
    plain = obj.chunked_loss(hidden.detach(), labels, weight, gamma=4.0, chunk=7)
    assert float(plain.tau_sum) == float(out.tau_sum) and plain.blocks == out.blocks
