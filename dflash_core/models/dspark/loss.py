"""DSpark's training objective (docs/algorithm.md, DSpark): labels and Markov inputs of a block,
slot weights, and the loss 0.1 CE + 0.9 TV + 1.0 confidence, chunked over block positions.

Per labelled slot (row) with drafter state h, target state T (the target's last hidden state
after its final norm, at the same position), frozen lm_head W and Markov head (W1, W2):

    p_d = softmax(W h + W2 W1[prev])          (float32)
    p_t = softmax(W T)                        (float32, no gradient)
    CE  = -log p_d(label)
    TV  = ||p_d - p_t||_1                     (the L1 distance, not halved)
    c*  = clamp(1 - TV / 2, 0, 1)             (detached: the chance a sample of p_d is accepted)
    BCE = BCE_with_logits(confidence logit, c*)

weighted by w_j = exp(-j / gamma) on each block's surviving prefix (slots up to the first one
without a label) and normalised by the sum of the weights.

Memory: the rows x vocabulary probabilities never exist at once. ``loss_chunk`` rows at a time, a
custom autograd function computes CE and TV and keeps only its inputs; backward rebuilds the
chunk's logits and both distributions and applies the closed-form gradient
``dz = p_d * (g_tv * (s - <p_d, s>) + g_ce) - g_ce * onehot(label)``, s = sign(p_d - p_t).
With ``fused`` (drafter.fused_loss) fused_row_terms computes the same sums by the kernels of
models/fused_loss, the gradient made in the forward pass; row_terms is its reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_core.models import objective as obj
from dflash_core.models.objective import IGNORE, LabelRows

TERMS = ("ce", "tv", "conf")  # the loss terms, in the order of every [3] tensor below


def dspark_targets(wide_labels: torch.Tensor, anchor_tokens: torch.Tensor):
    """(labels, prev), both [n, A, B], from DFlash-layout labels one slot wider
    (``objective.block_labels`` with block size B+1: slot k holds the token at anchor+k) and the
    anchors' tokens [n, A].

    labels[j]: the token at anchor+j+1, IGNORE from the first slot without one on (the slot mask
    is a cumulative product: a slot after a failed one is never reached in decoding).
    prev[j]: the Markov head's input: the anchor token for slot 0, the token at anchor+j after."""
    lab = wide_labels[..., 1:]
    alive = (lab != IGNORE).long().cumprod(-1).bool()
    labels = torch.where(alive, lab, torch.full_like(lab, IGNORE))
    prev = torch.cat([anchor_tokens[..., None].to(lab.dtype), lab[..., :-1].clamp(min=0)], -1)
    return labels, prev


def anchor_tokens(input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """[n, A] the token at each anchor (padding anchors -1 read position 0; never labelled)."""
    return torch.gather(input_ids, 1, anchors.clamp(min=0))


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_j = exp(-j / gamma) for slots j = 0..B-1 (slot 0 weighs 1)."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / gamma)


def label_rows(labels: torch.Tensor, gamma: float) -> LabelRows:
    """The labelled slots of DSpark labels [n, A, B] and their weights, made where the labels
    live (the host: no GPU sync). ``blocks`` counts blocks whose slot 0 is labelled."""
    B = labels.shape[-1]
    rows = torch.nonzero(labels.reshape(-1) != IGNORE).squeeze(1)
    weights = slot_weights(B, gamma, labels.device)[rows % B]
    blocks = int((labels[..., 0] != IGNORE).sum())
    return LabelRows(rows, weights, float(weights.sum()), blocks, B)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def slot_logits(hidden, prev_embedded, lm_head_weight, w2) -> torch.Tensor:
    """lm_head(h) + W2 W1[prev] with both GEMMs in the lm_head's dtype and the sum in float32
    (or wider): the same formula decoding's chain uses (DSparkDrafter.markov_logits)."""
    dt = lm_head_weight.dtype
    z = F.linear(hidden.to(dt), lm_head_weight).to(_acc(dt))
    z += F.linear(prev_embedded.to(dt), w2.to(dt)).to(z.dtype)
    return z


def _target_probs(t, lm_head_weight) -> torch.Tensor:
    dt = lm_head_weight.dtype
    return F.linear(t.to(dt), lm_head_weight).to(_acc(dt)).softmax(-1)


class _LogitTerms(torch.autograd.Function):
    """Per-row CE and L1 distance of one chunk (and the argmax), keeping only the inputs:
    backward rebuilds the chunk's logits and distributions."""

    @staticmethod
    def forward(ctx, h, e, lm_w, w2, t, labels):
        with torch.autocast(h.device.type, enabled=False):
            z = slot_logits(h, e, lm_w, w2)
            preds = z.argmax(-1)
            lse = torch.logsumexp(z, -1)
            ce = lse - z.gather(1, labels[:, None]).squeeze(1)
            p = z.sub_(lse[:, None]).exp_()
            l1 = _target_probs(t, lm_w).sub_(p).abs_().sum(-1)
        ctx.save_for_backward(h, e, lm_w, w2, t, labels)
        ctx.mark_non_differentiable(preds)
        return ce, l1, preds

    @staticmethod
    def backward(ctx, g_ce, g_l1, _):
        h, e, lm_w, w2, t, labels = ctx.saved_tensors
        with torch.autocast(h.device.type, enabled=False):
            p = slot_logits(h, e, lm_w, w2).softmax(-1)
            g_ce = torch.zeros_like(p[:, 0]) if g_ce is None else g_ce.to(p.dtype)
            g_l1 = torch.zeros_like(p[:, 0]) if g_l1 is None else g_l1.to(p.dtype)
            s = _target_probs(t, lm_w).sub_(p).neg_().sign_()  # sign(p_d - p_t)
            ps = torch.bmm(p[:, None, :], s[:, :, None]).squeeze(-1)  # <p_d, s>, no [c, V] temp
            dz = s.sub_(ps).mul_(g_l1[:, None]).add_(g_ce[:, None]).mul_(p)
            dz[torch.arange(len(labels), device=dz.device), labels] -= g_ce
            del p
            dt = lm_w.dtype
            dz = dz.to(dt)
            need = ctx.needs_input_grad
            dh = (dz @ lm_w).to(h.dtype) if need[0] else None
            de = (dz @ w2.to(dt)).to(e.dtype) if need[1] else None
            dlm = (dz.t() @ h.to(dt)).to(lm_w.dtype) if need[2] else None
            dw2 = (dz.t() @ e.to(dt)).to(w2.dtype) if need[3] else None
        return dh, de, dlm, dw2, None, None


@dataclass
class RowTerms:
    """What the loss over a set of rows leaves: weighted sums (differentiable) and the argmax."""

    sums: torch.Tensor  # [3]: sum of w*CE, w*TV, w*BCE
    preds: torch.Tensor  # [N] argmax of each row's Markov-corrected logits
    # The fused path's coefficient-weighted sum of the three, which alone carries the gradient
    # (its sums carry none); None: the torch path's sums are differentiable.
    loss: torch.Tensor | None = None


def row_terms(h: torch.Tensor, t: torch.Tensor, prev: torch.Tensor, labels: torch.Tensor,
              weights: torch.Tensor, lm_head_weight: torch.Tensor, markov_head,
              confidence_head=None, chunk: int = 1024) -> RowTerms:
    """The three weighted loss sums over N rows. h: [N, H] drafter final states; t: [N, H]
    target post-norm last hidden states at the same positions; prev, labels: [N] ids; weights:
    [N]. ``chunk`` rows at a time (see the module's docstring); the confidence head (None: no
    BCE term) reads [h ; W1[prev]] and its label c* from TV, detached."""
    sums = []
    preds = []
    w2 = markov_head.markov_w2.weight
    chunk = max(1, chunk)
    for s in range(0, len(h), chunk):
        sl = slice(s, s + chunk)
        hs, e = h[sl], markov_head.embed(prev[sl])
        ce, l1, arg = _LogitTerms.apply(hs, e, lm_head_weight, w2, t[sl].detach(), labels[sl])
        w = weights[sl].to(ce.dtype)
        parts = [(w * ce).sum(), (w * l1).sum()]
        if confidence_head is not None:
            c_star = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
            logit = confidence_head(hs, e)
            bce = F.binary_cross_entropy_with_logits(logit, c_star.to(logit.dtype),
                                                     reduction="none")
            parts.append((w.to(bce.dtype) * bce).sum().to(ce.dtype))
        else:
            parts.append(ce.new_zeros(()))
        sums.append(torch.stack(parts))
        preds.append(arg)
    if not sums:
        return RowTerms(h.new_zeros(3, dtype=_acc(h.dtype)),
                        torch.zeros(0, dtype=torch.long, device=h.device))
    return RowTerms(torch.stack(sums).sum(0), torch.cat(preds))


def fused_row_terms(h: torch.Tensor, t: torch.Tensor, prev: torch.Tensor, labels: torch.Tensor,
                    weights: torch.Tensor, lm_head_weight: torch.Tensor, markov_head,
                    confidence_head, chunk: int, coef: torch.Tensor) -> RowTerms:
    """row_terms by the fused kernels (models/fused_loss, CUDA and Triton): the same sums and
    argmax, and ``loss`` = coef . sums, whose CE and TV gradients the kernels make in the forward
    pass from the rows' weights; the confidence head's BCE stays torch's (one logit per row)."""
    from dflash_core.models.fused_loss import autograd as fused_rows  # CUDA + Triton only

    e = markov_head.embed(prev)
    w = weights.to(_acc(h.dtype))
    out = fused_rows.spark_rows(h, e, lm_head_weight, markov_head.markov_w2.weight, t, labels,
                                coef[0] * w, coef[1] * w, chunk)
    ce_sum, tv_sum = (w * out.ce).sum(), (w * out.l1).sum()
    if confidence_head is not None:
        c_star = (1.0 - 0.5 * out.l1).clamp(0.0, 1.0)
        logit = confidence_head(h, e)
        bce = F.binary_cross_entropy_with_logits(logit, c_star.to(logit.dtype), reduction="none")
        bce_sum = (w.to(bce.dtype) * bce).sum().to(ce_sum.dtype)
    else:
        bce_sum = ce_sum.new_zeros(())
    sums = torch.stack([ce_sum, tv_sum, bce_sum.detach()])
    return RowTerms(sums, out.preds, out.loss.to(sums.dtype) + coef[2] * bce_sum)


@dataclass
class DSparkLossOut:
    loss: torch.Tensor  # weighted mean of ce_w CE + tv_w TV + conf_w BCE (differentiable)
    terms: torch.Tensor  # [3] detached weighted SUMS of CE, TV, BCE (divide by weight_sum)
    weight_sum: float
    tau_sum: torch.Tensor  # sum over blocks with slot 0 labelled of (correct prefix + 1)
    blocks: int

    def term_means(self) -> dict[str, float]:
        """{"ce", "tv", "conf"}: each term's weighted mean (reading it waits for the GPU)."""
        d = max(self.weight_sum, 1e-12)
        return dict(zip(TERMS, (float(v) / d for v in self.terms)))

    @property
    def tau_tf(self) -> float:
        return float(self.tau_sum) / self.blocks if self.blocks else 0.0


def tau_sum(preds: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Teacher-forced acceptance of DSpark blocks [n, A, B]: per block with slot 0 labelled, the
    length of the correct prefix of slots 0..B-1, plus one (at most B+1); summed, on the GPU."""
    hit = (preds == labels) & (labels != IGNORE)
    prefix = hit.long().cumprod(-1).sum(-1)
    has = labels[..., 0] != IGNORE
    return ((prefix + 1) * has).sum().float()


def dspark_loss(hidden: torch.Tensor, last_hidden: torch.Tensor, positions: torch.Tensor,
                labels: torch.Tensor, prev: torch.Tensor, drafter, *, gamma: float,
                loss_weights: tuple[float, float, float], chunk: int = 1024,
                rows: LabelRows | None = None, fused: bool = False) -> DSparkLossOut:
    """hidden: [n, A*B, H] drafter final states; last_hidden: [n, S, H] the target's post-norm
    last hidden states; positions: [n, A*B] each block slot's position (anchor + j: the target
    state there predicts the slot's label); labels, prev: [n, A, B] (dspark_targets), on
    hidden's device; rows: label_rows() made on the host. Only labelled slots are gathered: the
    target's distribution is made at those block positions alone. ``fused``: the rows' terms
    by models/fused_loss (CUDA and Triton; drafter.fused_loss), row_terms being its reference."""
    n, A, B = labels.shape
    if rows is None:
        rows = label_rows(labels, gamma)
    rows = rows.to(hidden.device)
    r = rows.rows
    S = last_hidden.shape[1]
    h = hidden.reshape(n * A * B, -1).index_select(0, r)
    flat_pos = (torch.arange(n, device=r.device)[:, None] * S + positions.clamp(0, S - 1))
    t = last_hidden.reshape(n * S, -1).index_select(0, flat_pos.reshape(-1).index_select(0, r))
    args = (h, t, prev.reshape(-1).index_select(0, r), labels.reshape(-1).index_select(0, r),
            rows.weights, drafter.lm_head.weight, drafter.markov_head, drafter.confidence_head,
            chunk)
    if fused:
        out = fused_row_terms(*args, torch.tensor(loss_weights, dtype=_acc(h.dtype),
                                                  device=h.device))
        weighted = out.loss
    else:
        out = row_terms(*args)
        coef = torch.tensor(loss_weights, dtype=out.sums.dtype, device=out.sums.device)
        weighted = (coef * out.sums).sum()
    loss = weighted / max(rows.weight_sum, 1e-12)
    preds = torch.full((n * A * B,), IGNORE, dtype=torch.long, device=hidden.device)
    preds[r] = out.preds
    return DSparkLossOut(loss, out.sums.detach(), rows.weight_sum,
                         tau_sum(preds.view(n, A, B), labels), rows.blocks)


@torch.no_grad()
def teacher_forced_preds(drafter, hidden: torch.Tensor, prev: torch.Tensor,
                         chunk: int = 1024) -> torch.Tensor:
    """[n, A, B] argmax of every slot's Markov-corrected logits with the given prev tokens
    (ground truth: teacher forcing). Needs no target state."""
    n, A, B = prev.shape
    h = hidden.reshape(n * A * B, -1)
    p = prev.reshape(-1)
    w, w2 = drafter.lm_head.weight, drafter.markov_head.markov_w2.weight
    chunk = max(1, chunk)
    out = [slot_logits(h[s: s + chunk], drafter.markov_head.embed(p[s: s + chunk]), w, w2)
           .argmax(-1) for s in range(0, len(h), chunk)]
    return torch.cat(out).view(n, A, B)


def wide_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                block_size: int) -> torch.Tensor:
    """DFlash-layout labels of width B+1 (what the loader prepares for a DSpark drafter)."""
    return obj.block_labels(input_ids, loss_mask, anchors, block_size + 1)

