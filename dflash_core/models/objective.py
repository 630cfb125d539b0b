"""The drafter's training objective (docs/algorithm.md): anchors, block labels, the slot weights of
the two losses (``drafter.loss``: DFlash's decayed weights or D-PACE's detached ones), chunked
cross-entropy over the borrowed lm_head, and teacher-forced tau."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_core.anchor_counts import anchors_for

IGNORE = -100


def anchor_rng(seed: int, epoch: int, sample_index: int) -> np.random.Generator:
    """Anchors depend only on (seed, epoch, sample): resampled every epoch, reproducible on resume
    and independent of which drafter GPU sees the sample."""
    return np.random.default_rng([seed, epoch, sample_index])


def valid_anchor_positions(loss_mask: np.ndarray) -> np.ndarray:
    """Positions p with loss_mask[p] = loss_mask[p+1] = 1."""
    m = np.asarray(loss_mask).astype(bool)
    return np.flatnonzero(m[:-1] & m[1:])


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, rng: np.random.Generator,
                   per_1k: float = 0.0) -> np.ndarray:
    """Distinct valid positions, uniformly without replacement, sorted: up to num_anchors, or
    with a density ``per_1k`` > 0 as many as anchor_counts.anchors_for gives its valid
    positions."""
    valid = valid_anchor_positions(loss_mask)
    want = anchors_for(len(valid), num_anchors, per_1k)
    if len(valid) > want:
        valid = rng.choice(valid, size=want, replace=False)
    return np.sort(valid)


def batch_anchors(loss_masks: list[np.ndarray], num_anchors: int, seed: int, epoch: int,
                  indices: list[int], pad_to: int = 1, per_1k: float = 0.0) -> torch.Tensor:
    """[n, A_max] anchors, -1 padded (A_max = most anchors any sequence got, >= 1, rounded up to
    a multiple of ``pad_to`` so compiled attention sees few distinct shapes)."""
    per = [sample_anchors(m, num_anchors, anchor_rng(seed, epoch, int(i)), per_1k)
           for m, i in zip(loss_masks, indices)]
    width = max(1, max((len(a) for a in per), default=1))
    width = min(-(-width // pad_to) * pad_to, max(num_anchors, width))
    out = torch.full((len(per), width), -1, dtype=torch.long)
    for r, a in enumerate(per):
        out[r, : len(a)] = torch.from_numpy(a.astype(np.int64))
    return out


def sequences_per_group(micro_block_tokens: int, block_tokens_per_sequence: int) -> int:
    """How many sequences one drafter forward/backward takes, so that at most
    ``micro_block_tokens`` block tokens (anchors x block size per sequence) are live; at least
    one. replica.py groups a batch by it, and the memory plan sizes activations by it."""
    return max(1, micro_block_tokens // max(1, block_tokens_per_sequence))


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """[n, A, B] labels: slot k holds the token at anchor+k (no shift); slot 0, padding blocks and
    positions past the end or outside the loss mask are IGNORE."""
    n, L = input_ids.shape
    pos = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)
    inside = (pos < L) & (anchors[:, :, None] >= 0)
    safe = pos.clamp(0, L - 1)
    flat = lambda t: torch.gather(t, 1, safe.view(n, -1)).view(pos.shape)  # noqa: E731
    ok = inside & (flat(loss_mask) > 0)
    ok[:, :, 0] = False
    return torch.where(ok, flat(input_ids), torch.full_like(pos, IGNORE))


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..B-1; slot 0 gets 0 (never trained)."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def _chunk_ce(hidden, weight, labels):
    """Per-row cross-entropy of one chunk (float32) and its argmax."""
    logits = F.linear(hidden.to(weight.dtype), weight).float()
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1)


@dataclass
class LabelRows:
    """Which slots of a group carry a label, and their weights: worked out where the labels live
    (on the host, from the batch) so the GPU step never waits to learn its own loss's shape.
    D-PACE's weights depend on the step's own cross-entropies, so with ``dpace_alpha`` set they
    are made on the GPU in chunked_loss and ``weights`` / ``weight_sum`` are None here."""

    rows: torch.Tensor  # flat indices into n*A*B of the slots the loss reads
    weights: torch.Tensor | None  # their slot weights (the DFlash loss)
    weight_sum: float | None
    blocks: int  # blocks with a label in slot 1 (the ones teacher-forced tau averages over)
    block_size: int = 0
    dpace_alpha: float | None = None  # None: the DFlash loss

    def to(self, device) -> "LabelRows":
        w = None if self.weights is None else self.weights.to(device, non_blocking=True)
        return replace(self, rows=self.rows.to(device, non_blocking=True), weights=w)


def valid_prefix(labels: torch.Tensor) -> torch.Tensor:
    """[n, A, B] bool: the slots 1, 2, ... of each block up to (not including) its first slot
    without a label. Slot 0 is never in it."""
    has = labels != IGNORE
    out = torch.zeros_like(has)
    out[..., 1:] = has[..., 1:].long().cumprod(-1).bool()
    return out


def label_rows(labels: torch.Tensor, gamma: float, dpace_alpha: float | None = None) -> LabelRows:
    """The labelled slots of [n, A, B] labels, on the labels' device (host labels: no GPU sync).

    The DFlash loss reads every labelled slot. D-PACE (``dpace_alpha`` set) reads each block's
    valid prefix only: its weights are the chances that drafting reaches each slot, and drafting
    cannot get past a slot the loss knows nothing of (outside the loss mask: another turn's
    tokens), so the slots after the first unlabelled one get weight 0 and are not projected."""
    B = labels.shape[-1]
    blocks = int((labels[:, :, 1] != IGNORE).sum()) if B > 1 else 0
    if dpace_alpha is not None:
        rows = torch.nonzero(valid_prefix(labels).reshape(-1)).squeeze(1)
        return LabelRows(rows, None, None, blocks, B, float(dpace_alpha))
    rows = torch.nonzero(labels.reshape(-1) != IGNORE).squeeze(1)
    weights = slot_weights(B, gamma, labels.device)[rows % B]
    return LabelRows(rows, weights, float(weights.sum()), blocks, B)


def dpace_weights(ce: torch.Tensor, rows: torch.Tensor, slots: int, block_size: int,
                  alpha: float) -> torch.Tensor:
    """D-PACE's weights (arXiv 2605.18810) of the slots ``rows`` (flat indices into ``slots``
    = n*A*B, each block's valid prefix, as label_rows gives them) from their cross-entropies
    ``ce``: with q_i = (1 - alpha) exp(-CE_i) + alpha, slot j weighs
    w_j = sum over m >= j of prod over i <= m of q_i (i, m over the block's valid prefix).
    exp(-CE) is the probability the drafter gives the label, so prod q is a softened chance of
    accepting every slot up to m. Computed without gradient: the weights steer the loss, they are
    not trained."""
    with torch.no_grad():
        q = (1.0 - alpha) * torch.exp(-ce.float()) + alpha
        dense = torch.ones(slots, device=ce.device, dtype=torch.float32)
        dense[rows] = q
        valid = torch.zeros(slots, device=ce.device, dtype=torch.float32)
        valid[rows] = 1.0
        # Outside the valid prefix q is 1 and the reach is masked to 0, so those slots add
        # nothing to any valid slot's sum.
        reach = dense.view(-1, block_size).cumprod(-1) * valid.view(-1, block_size)
        w = reach.flip(-1).cumsum(-1).flip(-1)
        return w.reshape(-1)[rows]


class GroupTargets(NamedTuple):
    """One micro-group's targets as a family's step loss makes them before the forward: its
    (host) labels, the labelled slots it trains on, and what else its loss needs."""

    labels: torch.Tensor
    picked: LabelRows
    extra: tuple = ()


@dataclass
class LossOut:
    loss: torch.Tensor  # weighted mean CE (differentiable)
    # Sum of weights in use (for exact averaging across micro-batches): a float for the DFlash
    # loss, a tensor on hidden's device for D-PACE (reading it would wait for the GPU).
    weight_sum: float | torch.Tensor
    tau_sum: torch.Tensor  # sum over blocks with a label in slot 1 of (correct prefix + 1)
    blocks: int

    @property
    def tau_tf(self) -> float:
        """Teacher-forced tau averaged over blocks (reading it waits for the GPU)."""
        return float(self.tau_sum) / self.blocks if self.blocks else 0.0


def chunked_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head_weight: torch.Tensor,
                 gamma: float, chunk: int = 4096, rows: LabelRows | None = None,
                 dpace_alpha: float | None = None, fused: bool = False) -> LossOut:
    """hidden: [n, A*B, H] final drafter states; labels: [n, A, B] (on hidden's device). The (A*B)
    x V logits never exist at once: only slots with a label are projected, ``chunk`` rows at a
    time, and each chunk is recomputed in backward instead of kept; what stays is one float32
    cross-entropy per row, which both losses weight outside the recomputed part. ``rows``:
    label_rows() of the same labels, made on the host; without it they are found here (with
    ``dpace_alpha``: the D-PACE loss), which waits for the GPU. ``fused``: the same loss by
    models/fused_loss (CUDA and Triton; drafter.fused_loss), this being its reference."""
    n, A, B = labels.shape
    flat_labels = labels.reshape(-1)
    if rows is None:
        rows = label_rows(labels, gamma, dpace_alpha)
    rows = rows.to(hidden.device)
    h = hidden.reshape(n * A * B, -1)
    if fused:
        return _fused_chunked_loss(h, labels, lm_head_weight, chunk, rows)
    preds = torch.full_like(flat_labels, IGNORE)
    parts = []
    for s in range(0, len(rows.rows), chunk):
        r = rows.rows[s : s + chunk]
        hs = h.index_select(0, r)
        if torch.is_grad_enabled() and hs.requires_grad:
            ce, arg = checkpoint(_chunk_ce, hs, lm_head_weight, flat_labels[r],
                                 use_reentrant=False)
        else:
            ce, arg = _chunk_ce(hs, lm_head_weight, flat_labels[r])
        parts.append(ce)
        preds[r] = arg.detach()
    ce = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
    if rows.dpace_alpha is not None:
        w = dpace_weights(ce.detach(), rows.rows, n * A * B, B, rows.dpace_alpha)
        weight_sum = w.sum()
        denom = weight_sum.clamp(min=1e-12)
    else:
        w, weight_sum = rows.weights, rows.weight_sum
        denom = max(weight_sum, 1e-12)
    loss_sum = (ce * w).sum()
    return LossOut(loss=loss_sum / denom, weight_sum=weight_sum,
                   tau_sum=tau_sum(preds.view(n, A, B), labels), blocks=rows.blocks)


def _fused_chunked_loss(h: torch.Tensor, labels: torch.Tensor, lm_head_weight: torch.Tensor,
                        chunk: int, rows: LabelRows) -> LossOut:
    """chunked_loss by the fused kernels: the same rows, weights and sums. The gradient is made
    in the forward pass from the rows' weights, so D-PACE's, which need every row's CE, are
    found by a pass without gradient first."""
    from dflash_core.models.fused_loss import autograd as fused_rows  # CUDA + Triton only

    n, A, B = labels.shape
    flat_labels = labels.reshape(-1)
    hs = h.index_select(0, rows.rows)
    lab = flat_labels.index_select(0, rows.rows)
    if rows.dpace_alpha is not None:
        ce, arg = fused_rows.ce_stats(hs, lm_head_weight, lab, chunk)
        w = dpace_weights(ce, rows.rows, n * A * B, B, rows.dpace_alpha)
        weight_sum = w.sum()
        denom = weight_sum.clamp(min=1e-12)
        if torch.is_grad_enabled() and hs.requires_grad:
            loss_sum = fused_rows.ce_rows(hs, lm_head_weight, lab, w, chunk).loss
        else:
            loss_sum = (ce * w).sum()
    else:
        out = fused_rows.ce_rows(hs, lm_head_weight, lab, rows.weights, chunk)
        arg, loss_sum, weight_sum = out.preds, out.loss, rows.weight_sum
        denom = max(weight_sum, 1e-12)
    preds = torch.full_like(flat_labels, IGNORE)
    preds[rows.rows] = arg
    return LossOut(loss=loss_sum / denom, weight_sum=weight_sum,
                   tau_sum=tau_sum(preds.view(n, A, B), labels), blocks=rows.blocks)


def tau_sum(preds: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over blocks with a label in slot 1 of (correct-prefix length + 1), as a tensor on the
    GPU: nothing here waits for it."""
    hit = (preds == labels) & (labels != IGNORE)
    prefix = hit[:, :, 1:].long().cumprod(-1).sum(-1)  # [n, A]
    has = labels[:, :, 1] != IGNORE
    return ((prefix + 1) * has).sum().float()


def teacher_forced_tau(preds: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """(tau, blocks). Per block: length of the correct prefix of slots 1..B-1, plus one; mean over
    blocks that have a label in slot 1. A perfect predictor of full blocks gives B."""
    blocks = int((labels[:, :, 1] != IGNORE).sum())
    if blocks == 0:
        return 0.0, 0
    return float(tau_sum(preds, labels)) / blocks, blocks


def dense_reference_loss(hidden, labels, lm_head_weight, gamma):
    """Unchunked loss, for tests: the whole logits tensor at once."""
    n, A, B = labels.shape
    logits = F.linear(hidden.reshape(n * A * B, -1), lm_head_weight).float()
    flat = labels.reshape(-1)
    ce = F.cross_entropy(logits, flat, reduction="none", ignore_index=IGNORE)
    w = slot_weights(B, gamma, hidden.device).repeat(n * A) * (flat != IGNORE)
    return (ce * w).sum() / w.sum()


def lr_at(step: int, total: int, lr: float, warmup_frac: float, min_lr_frac: float = 0.0) -> float:
    """Linear warmup then cosine decay to min_lr_frac * lr."""
    warm = max(1, int(round(total * warmup_frac))) if warmup_frac > 0 else 0
    if step < warm:
        return lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    floor = lr * min_lr_frac
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
