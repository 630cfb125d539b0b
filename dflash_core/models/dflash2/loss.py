"""DFlash2's objective (docs/algorithm.md "DFlash2"): DFlash's block loss plus alpha times the
selector's K-way cross-entropy, both on the labelled slots 1..B-1 with DFlash's slot weights.

Per labelled slot k of a block at anchor s (label y = the data's token at s+k):

    u      = softcap(m * lm_head(h))                 (float32)
    CE     = logsumexp(u) - u[y]                     the base term (DFlash's, on u)
    C      = TopK(z, K) (no gradient through the choice; z the logits in the lm_head's dtype,
             as vLLM takes them: u's top-K, ties aside), U = u[C]
    S(b)   = U(b) + <A[a] * W_h h, B[b]>             a = the token at s+k-1: teacher-forced
    SEL    = logsumexp_C S - S(y)                    when y is in C (selector_missing "drop":
                                                     otherwise no term), or with y put in
                                                     C's last place ("inject")
    loss   = (sum w CE + alpha sum w SEL) / sum w    (SpecForge's normalisation)

The slots' teacher-forced predictions are the selector's choice argmax_b S(b): the step's tau is
the selector's, the path decoding takes. Memory as DFlash's: ``loss_chunk`` rows at a time, each
chunk's logits recomputed in backward. With ``fused`` (drafter.fused_loss) the same sums come from
models/fused_loss/selector_rows.py (the gradients made in the forward pass, nothing recomputed);
this torch path is its reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from dflash_core.config import ConfigError, DrafterConfig, default_gamma
from dflash_core.families.dflash2 import DFLASH2, DFlash2Settings
from dflash_core.models import objective as obj
from dflash_core.models.dflash2.selector import unary
from dflash_core.models.fused_loss import select as fused_loss
from dflash_core.models.objective import IGNORE, LabelRows

TERMS = ("ce", "sel", "hit")  # sums of w*CE, w*SEL, w*[label among the K candidates]


def predecessors(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int
                 ) -> torch.Tensor:
    """[n, A, B] the token before each slot (slot k: the token at anchor+k-1; the anchor's for
    slot 1): the selector's teacher-forced predecessor. Slot 0 and padding read any token (they
    carry no label)."""
    n, L = input_ids.shape
    pos = anchors[:, :, None] + torch.arange(block_size, device=anchors.device) - 1
    safe = pos.clamp(0, L - 1).reshape(n, -1)
    return torch.gather(input_ids, 1, safe).view(pos.shape)


def _rows(h, lm_w, gate_w, pred_cb, succ_cb, labels, prev, k, multiplier, softcap, inject):
    """One chunk of rows: (CE, SEL, hit, unary argmax, selector's choice), each [c]."""
    z = torch.nn.functional.linear(h.to(lm_w.dtype), lm_w)
    u = unary(z, multiplier, softcap)
    lse = torch.logsumexp(u, -1)
    ce = lse - u.gather(1, labels[:, None]).squeeze(1)
    uarg = u.argmax(-1)
    # The candidates are not trained; taken from the logits in the head's dtype, as vLLM takes
    # them (u is increasing in z: the same set, ties aside) and as the fused loss does.
    cand = z.detach().topk(k, dim=-1).indices
    hit = (cand == labels[:, None]).any(1)
    if inject:
        cand[:, -1] = torch.where(hit, cand[:, -1], labels)
    gate = torch.nn.functional.linear(h.float(), gate_w.float())
    a = pred_cb[prev].float() * gate
    if k * succ_cb.shape[1] > succ_cb.shape[0]:
        # a vocabulary smaller than K x r (the demo's): one product over it is cheaper than
        # gathering K codebook rows per slot; the same sums
        pair = (a @ succ_cb.float().t()).gather(1, cand)
    else:
        pair = (succ_cb[cand].float() @ a[..., None]).squeeze(-1)
    s = u.gather(1, cand) + pair  # [c, K]
    at = (cand == labels[:, None]).float().argmax(1)  # the label's place (0 when absent)
    sel = torch.logsumexp(s, -1) - s.gather(1, at[:, None]).squeeze(1)
    counted = torch.ones_like(hit) if inject else hit
    sel = torch.where(counted, sel, torch.zeros_like(sel))
    choice = cand.gather(1, s.argmax(-1, keepdim=True)).squeeze(1)
    return ce, sel, hit.float(), uarg, choice


@dataclass
class DFlash2LossOut:
    loss: torch.Tensor  # (sum w CE + alpha sum w SEL) / sum w (differentiable)
    weight_sum: float
    tau_sum: torch.Tensor  # blocks' teacher-forced (selector prefix + 1), summed
    blocks: int
    terms: torch.Tensor  # [3] detached sums of w*CE, w*SEL, w*hit (divide by weight_sum)
    unary_tau_sum: torch.Tensor  # the same tau with the unary argmax

    @property
    def tau_tf(self) -> float:
        return float(self.tau_sum) / self.blocks if self.blocks else 0.0


def dflash2_loss(hidden: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor, drafter, *,
                 gamma: float, alpha: float, inject: bool, chunk: int = 4096,
                 rows: LabelRows | None = None, fused: bool = False) -> DFlash2LossOut:
    """hidden: [n, A*B, H] drafter final states; labels, prev: [n, A, B] (DFlash's labels and
    ``predecessors``) on hidden's device; rows: obj.label_rows() made on the host. ``fused``:
    the rows by models/fused_loss/selector_rows.py (the Triton row kernel on CUDA, its torch
    twin elsewhere; drafter.fused_loss), this path being its reference."""
    n, A, B = labels.shape
    if rows is None:
        rows = obj.label_rows(labels, gamma)
    rows = rows.to(hidden.device)
    r = rows.rows
    h = hidden.reshape(n * A * B, -1)
    flat_labels, flat_prev = labels.reshape(-1), prev.reshape(-1)
    sel_mod = drafter.candidate_selector
    params = (drafter.lm_head.weight, sel_mod.hidden_projection.weight,
              sel_mod.predecessor_codebook, sel_mod.successor_codebook)
    fixed = (drafter.selector_top_k, drafter.output_multiplier, drafter.softcap, inject)
    if fused:
        return _fused_loss(h, flat_labels, flat_prev, params, fixed, rows, alpha, chunk,
                           labels.shape)
    parts = []
    upreds = torch.full_like(flat_labels, IGNORE)
    spreds = torch.full_like(flat_labels, IGNORE)
    for s in range(0, len(r), max(1, chunk)):
        idx = r[s: s + chunk]
        args = (h.index_select(0, idx), *params, flat_labels[idx], flat_prev[idx], *fixed)
        if torch.is_grad_enabled() and args[0].requires_grad:
            ce, sel, hit, uarg, choice = checkpoint(_rows, *args, use_reentrant=False)
        else:
            ce, sel, hit, uarg, choice = _rows(*args)
        parts.append(torch.stack([ce, sel, hit]))
        upreds[idx], spreds[idx] = uarg.detach(), choice.detach()
    per = torch.cat(parts, 1) if parts else h.new_zeros(3, 0, dtype=torch.float32)
    w = rows.weights.to(per.dtype)
    sums = per @ w if per.shape[1] else per.new_zeros(3)
    loss = (sums[0] + alpha * sums[1]) / max(rows.weight_sum, 1e-12)
    return DFlash2LossOut(loss, rows.weight_sum, obj.tau_sum(spreds.view(n, A, B), labels),
                          rows.blocks, sums.detach(), obj.tau_sum(upreds.view(n, A, B), labels))


def _fused_loss(h, flat_labels, flat_prev, params, fixed, rows: LabelRows, alpha: float,
                chunk: int, shape) -> DFlash2LossOut:
    """dflash2_loss by the fused rows: the same rows, weights and sums."""
    from dflash_core.models.fused_loss.selector_rows import selector_rows

    n, A, B = shape
    r = rows.rows
    k, multiplier, softcap, inject = fixed
    w = rows.weights.to(torch.float32)
    out = selector_rows(h.index_select(0, r), *params, flat_labels.index_select(0, r),
                        flat_prev.index_select(0, r), w, alpha * w, k=k, multiplier=multiplier,
                        softcap=softcap, inject=inject, chunk=chunk)
    sums = torch.stack([w @ out.ce, w @ out.sel, w @ out.hit]) if len(r) else w.new_zeros(3)
    upreds = torch.full_like(flat_labels, IGNORE)
    spreds = torch.full_like(flat_labels, IGNORE)
    upreds[r], spreds[r] = out.unary_preds, out.choice
    labels = flat_labels.view(n, A, B)
    return DFlash2LossOut(out.loss / max(rows.weight_sum, 1e-12), rows.weight_sum,
                          obj.tau_sum(spreds.view(n, A, B), labels), rows.blocks, sums.detach(),
                          obj.tau_sum(upreds.view(n, A, B), labels))


class DFlash2StepLoss:
    """The step loss a replica runs on each micro-group (DFlashStepLoss's interface)."""

    stats: tuple[str, ...] = TERMS

    def __init__(self, drafter, dcfg: DrafterConfig, settings: DFlash2Settings | None = None):
        for refused in DFLASH2.refusals(dcfg):  # written once, in the family
            raise ConfigError(refused.key, refused.message, hint=refused.hint)
        self.settings = (settings or DFlash2Settings(
            block_size=drafter.block_size, selector_alpha=float(dcfg.selector_alpha),
            selector_missing=str(dcfg.selector_missing))).check()
        self.gamma = dcfg.gamma or default_gamma(drafter.block_size)
        self.chunk = dcfg.loss_chunk
        self.fused_mode = dcfg.fused_loss  # resolved per device: the drafter's is known later

    def check_features(self, drafter, features: torch.Tensor) -> None:
        """DFlash2 takes the k layer features as they come (as DFlash)."""

    def targets(self, drafter, feats, labels, input_ids, anchors):
        """DFlash's labels and slot weights; the teacher-forced predecessors beside them."""
        prev = predecessors(input_ids, anchors, labels.shape[-1])
        return feats, obj.GroupTargets(labels, obj.label_rows(labels, self.gamma), (prev,))

    def __call__(self, drafter, hidden, pos, labels, t: obj.GroupTargets) -> DFlash2LossOut:
        (prev,) = t.extra
        s = self.settings
        return dflash2_loss(hidden, labels, prev.to(hidden.device, non_blocking=True), drafter,
                            gamma=self.gamma, alpha=s.selector_alpha,
                            inject=s.selector_missing == "inject", chunk=self.chunk,
                            rows=t.picked,
                            fused=fused_loss.fused(self.fused_mode, hidden.device.type))
