"""Data/target agreement: the share of trained labels that equal the target's own greedy next
token (docs/algorithm.md, Acceptance).

DFlash trains the drafter to predict what the target would write. When the responses of the data
were written by another model (or by this target under another template or sampling), many labels
are tokens the target would not pick, and exact acceptance stays low however far the loss falls.
This measures it directly: on a sample of trained positions t (loss_mask[t] = 1), does
``argmax(lm_head(h[t-1]))`` equal ``input_ids[t]``?

How it is computed, and why this way: the target's base model (embeddings, every decoder layer,
the final norm) runs over the sample, which gives the final-normed hidden states [T, H]; only the
sampled positions' rows are projected by the target's own lm_head, ``chunk`` vocabulary rows at a
time, keeping a running maximum. The [T, V] logits never exist (for a 248k vocabulary and a
3k-token sample they would be ~3 GB in fp32), and nothing new is loaded: the lm_head is the one
the drafter already borrows. In a run the target stage stops its forward after the last chosen
layer; this function runs the whole stack once, on a few samples, at the first evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

DEFAULT_POSITIONS = 512  # positions sampled: +-2 points of share at 95% for shares near 0.5
DEFAULT_CHUNK = 32768  # vocabulary rows per lm_head piece: [positions, chunk] fp32 logits live


@dataclass(frozen=True)
class Agreement:
    agree: int
    total: int

    @property
    def share(self) -> float:
        return self.agree / self.total if self.total else 0.0


def _parts(target_model):
    """(base model that ends in the final norm, lm_head): from a TargetModel or an HF CausalLM."""
    decoder = getattr(target_model, "decoder", None)
    head = getattr(target_model, "lm_head", None)
    if decoder is None or not hasattr(decoder, "layers"):
        decoder = getattr(target_model, "model", None)
    if hasattr(target_model, "get_output_embeddings") and head is None:
        head = target_model.get_output_embeddings()
    if decoder is None or head is None:
        raise TypeError(f"{type(target_model).__name__} has no base model (.model) and lm_head: "
                        "pass a TargetModel or an HF causal LM")
    return decoder, head


def _device(module) -> torch.device:
    return next(module.parameters()).device


@torch.no_grad()
def greedy_at(hidden: torch.Tensor, lm_head: torch.nn.Module, chunk: int = DEFAULT_CHUNK
              ) -> torch.Tensor:
    """argmax over the vocabulary of ``lm_head(hidden)`` for hidden [P, H], ``chunk`` vocabulary
    rows at a time (ties go to the lowest id, as a full argmax)."""
    weight = lm_head.weight
    bias = getattr(lm_head, "bias", None)
    h = hidden.to(weight.dtype)
    best = torch.full((h.shape[0],), float("-inf"), device=h.device)
    arg = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
    for s in range(0, weight.shape[0], max(1, chunk)):
        w = weight[s: s + chunk]
        logits = (h @ w.T).float()
        if bias is not None:
            logits = logits + bias[s: s + chunk].float()
        val, idx = logits.max(-1)
        better = val > best  # strict: an equal value later in the vocabulary keeps the earlier id
        best = torch.where(better, val, best)
        arg = torch.where(better, idx + s, arg)
    return arg


def _as_rows(x, name: str) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().long()
        if t.dim() == 1:
            return [t]
        if t.dim() == 2:
            return list(t)
        raise ValueError(f"{name} must be [T] or [b, T], got shape {tuple(t.shape)}")
    rows = list(x)
    if rows and not isinstance(rows[0], (Sequence, np.ndarray, torch.Tensor)):
        rows = [rows]  # one flat sequence of ints
    return [torch.as_tensor(np.asarray(r), dtype=torch.long) for r in rows]


def sample_positions(loss_masks: list[torch.Tensor], max_positions: int, seed: int = 0
                     ) -> list[tuple[int, int]]:
    """(row, t) of up to ``max_positions`` trained positions t >= 1 (t = 0 has no previous
    token to predict it from), uniformly without replacement, seeded: the same every time."""
    cand = [(r, int(t)) for r, m in enumerate(loss_masks)
            for t in torch.nonzero(m[1:] > 0).flatten().add(1).tolist()]
    if len(cand) <= max_positions:
        return cand
    pick = np.random.default_rng([seed, 25]).choice(len(cand), size=max_positions, replace=False)
    return sorted(cand[i] for i in pick)


@torch.no_grad()
def label_agreement(target_model, input_ids, loss_mask, max_positions: int = DEFAULT_POSITIONS,
                    chunk: int = DEFAULT_CHUNK, seed: int = 0, greedy=greedy_at
                    ) -> tuple[int, int]:
    """(agree, total): of ``total`` sampled trained positions, how many labels equal the target's
    greedy next token.

    ``target_model``: a ``target.TargetModel`` or an HF causal LM. ``input_ids`` / ``loss_mask``:
    one sequence [T], a right-padded batch [b, T] (padding must have loss_mask 0), or a list of
    sequences of different lengths. Each row with a sampled position runs once through the
    target, cut after its last sampled position; only the sampled rows meet the lm_head.
    ``greedy``: ``greedy_at``, or a target group rank's argmax through the lm_head module (its
    weight split between the ranks). A target whose layers run in a target group
    (target_group/remote.GroupTarget) answers itself, from its ranks.
    """
    own = getattr(target_model, "label_agreement", None)
    if own is not None:
        return own(input_ids, loss_mask, max_positions, chunk, seed)
    decoder, head = _parts(target_model)
    ids_rows, mask_rows = _as_rows(input_ids, "input_ids"), _as_rows(loss_mask, "loss_mask")
    if len(ids_rows) != len(mask_rows) or any(len(a) != len(b)
                                              for a, b in zip(ids_rows, mask_rows)):
        raise ValueError("input_ids and loss_mask must have the same shape")
    picked = sample_positions(mask_rows, max_positions, seed)
    dev = _device(decoder)
    agree = 0
    for r in sorted({r for r, _ in picked}):
        ts = torch.tensor([t for rr, t in picked if rr == r], dtype=torch.long)
        ids = ids_rows[r][: int(ts.max())].to(dev)  # the last label needs hidden states up to t-1
        hidden = decoder(input_ids=ids[None], use_cache=False).last_hidden_state[0]
        pred = greedy(hidden[(ts - 1).to(dev)], head, chunk).cpu()
        agree += int((pred == ids_rows[r][ts]).sum())
    return agree, len(picked)


def dataset_agreement(target_model, dataset, indices: Sequence[int],
                      max_positions: int = DEFAULT_POSITIONS, chunk: int = DEFAULT_CHUNK,
                      seed: int = 0) -> Agreement:
    """``label_agreement`` over samples ``indices`` of a ``data.ShardedDataset`` (its
    ``get(i) -> (input_ids, loss_mask)``)."""
    ids, masks = zip(*(dataset.get(int(i)) for i in indices)) if len(indices) else ((), ())
    if not ids:
        return Agreement(0, 0)
    agree, total = label_agreement(target_model, list(ids), list(masks), max_positions, chunk,
                                   seed)
    return Agreement(agree, total)
