"""The DFlash training objective (docs/algorithm.md): anchors, block labels, decayed weights, chunked
cross-entropy over the borrowed lm_head, and teacher-forced tau."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100


def anchor_rng(seed: int, epoch: int, sample_index: int) -> np.random.Generator:
    """Anchors depend only on (seed, epoch, sample): resampled every epoch, reproducible on resume
    and independent of which drafter GPU sees the sample."""
    return np.random.default_rng([seed, epoch, sample_index])


def valid_anchor_positions(loss_mask: np.ndarray) -> np.ndarray:
    """Positions p with loss_mask[p] = loss_mask[p+1] = 1."""
    m = np.asarray(loss_mask).astype(bool)
    return np.flatnonzero(m[:-1] & m[1:])


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, rng: np.random.Generator) -> np.ndarray:
    """Up to num_anchors distinct valid positions, uniformly without replacement, sorted."""
    valid = valid_anchor_positions(loss_mask)
    if len(valid) > num_anchors:
        valid = rng.choice(valid, size=num_anchors, replace=False)
    return np.sort(valid)


def batch_anchors(loss_masks: list[np.ndarray], num_anchors: int, seed: int, epoch: int,
                  indices: list[int], pad_to: int = 1) -> torch.Tensor:
    """[n, A_max] anchors, -1 padded (A_max = most anchors any sequence got, >= 1, rounded up to
    a multiple of ``pad_to`` so compiled attention sees few distinct shapes)."""
    per = [sample_anchors(m, num_anchors, anchor_rng(seed, epoch, int(i)))
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
    one. trainer.py groups a batch by it, and the memory plan sizes activations by it."""
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


def _chunk_ce(hidden, weight, labels, w):
    logits = F.linear(hidden.to(weight.dtype), weight).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * w).sum(), logits.argmax(-1)


@dataclass
class LabelRows:
    """Which slots of a group carry a label, and their weights: worked out where the labels live
    (on the host, from the batch) so the GPU step never waits to learn its own loss's shape."""

    rows: torch.Tensor  # flat indices into n*A*B of the labelled slots
    weights: torch.Tensor  # their slot weights
    weight_sum: float
    blocks: int  # blocks with a label in slot 1 (the ones teacher-forced tau averages over)

    def to(self, device) -> "LabelRows":
        return LabelRows(self.rows.to(device, non_blocking=True),
                         self.weights.to(device, non_blocking=True), self.weight_sum, self.blocks)


def label_rows(labels: torch.Tensor, gamma: float) -> LabelRows:
    """The labelled slots of [n, A, B] labels, on the labels' device (host labels: no GPU sync)."""
    B = labels.shape[-1]
    rows = torch.nonzero(labels.reshape(-1) != IGNORE).squeeze(1)
    weights = slot_weights(B, gamma, labels.device)[rows % B]
    blocks = int((labels[:, :, 1] != IGNORE).sum()) if B > 1 else 0
    return LabelRows(rows, weights, float(weights.sum()), blocks)


@dataclass
class LossOut:
    loss: torch.Tensor  # weighted mean CE (differentiable)
    weight_sum: float  # sum of weights in use (for exact averaging across micro-batches)
    tau_sum: torch.Tensor  # sum over blocks with a label in slot 1 of (correct prefix + 1)
    blocks: int

    @property
    def tau_tf(self) -> float:
        """Teacher-forced tau averaged over blocks (reading it waits for the GPU)."""
        return float(self.tau_sum) / self.blocks if self.blocks else 0.0


def chunked_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head_weight: torch.Tensor,
                 gamma: float, chunk: int = 4096, rows: LabelRows | None = None) -> LossOut:
    """hidden: [n, A*B, H] final drafter states; labels: [n, A, B] (on hidden's device). The (A*B)
    x V logits never exist at once: only slots with a label are projected, ``chunk`` rows at a
    time, and each chunk is recomputed in backward instead of kept. ``rows``: label_rows() of the
    same labels, made on the host; without it they are found here, which waits for the GPU."""
    n, A, B = labels.shape
    flat_labels = labels.reshape(-1)
    if rows is None:
        rows = label_rows(labels, gamma)
    rows = rows.to(hidden.device)
    h = hidden.reshape(n * A * B, -1)
    preds = torch.full_like(flat_labels, IGNORE)
    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, len(rows.rows), chunk):
        r = rows.rows[s : s + chunk]
        w = rows.weights[s : s + chunk]
        hs = h.index_select(0, r)
        if torch.is_grad_enabled() and hs.requires_grad:
            part, arg = checkpoint(_chunk_ce, hs, lm_head_weight, flat_labels[r], w,
                                   use_reentrant=False)
        else:
            part, arg = _chunk_ce(hs, lm_head_weight, flat_labels[r], w)
        loss_sum = loss_sum + part
        preds[r] = arg.detach()
    loss = loss_sum / max(rows.weight_sum, 1e-12)
    return LossOut(loss=loss, weight_sum=rows.weight_sum,
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
