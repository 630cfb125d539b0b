"""One round's proposals for several prompts in one drafter forward.

The drafter's own forward (the one training runs) takes a batch of contexts and an anchor per
row: row i's block ``[last token, MASK x (B-1)]`` sits at positions ``S_i .. S_i+B-1`` and sees
the context positions before ``S_i`` only, so right-padded contexts of different lengths share
one forward and each row gets what drafting it alone gives (``DFlashDrafter.draft``,
``DSparkDrafter.chain_draft``: the tests compare).

- DFlash: slots 1..B-1 of the block, each the argmax of its logits (greedy) or a draw from
  softmax(logits / T) (sampled; the slots are drawn independently, as the reference does).
- DSpark: slots 0..B-1 chained through the Markov head, slot j's logits taking the token chosen
  at slot j-1 (the anchor for slot 0), chosen by argmax or drawn at T; with a confidence head,
  each slot's confidence from the same inputs (what the run's evaluation calibrates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_core.bench_eval.sampling import probabilities


@dataclass
class Proposal:
    tokens: torch.Tensor  # [m, D] long: D = drafts a round proposes
    probs: torch.Tensor | None  # [m, D, V] float32: each draft's distribution (sampled only)
    confidences: torch.Tensor | None = None  # [m, D]: DSpark's confidence head, when it has one


def _backbone(drafter, context: torch.Tensor, lengths: list[int], last: list[int]):
    """Final-normed block states [m, B, H] of each row's block at its anchor."""
    m, B, dev = context.shape[0], drafter.block_size, context.device
    anchors = torch.tensor(lengths, device=dev, dtype=torch.long)[:, None]
    ids = torch.full((m, B), drafter.mask_token_id, dtype=torch.long, device=dev)
    ids[:, 0] = torch.tensor(last, device=dev, dtype=torch.long)
    pos = anchors + torch.arange(B, device=dev)
    embeds = drafter.embed_tokens(ids).to(drafter.fc.weight.dtype)
    return drafter(context, embeds, pos, anchors)


def _pick(logits: torch.Tensor, temperature: float,
          gens) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows' tokens [m] from logits [m, V]: argmax, or one draw per row with its generator."""
    if temperature <= 0:
        return logits.argmax(-1), None
    probs = probabilities(logits, temperature)
    toks = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0]
                        for i, g in enumerate(gens)])
    return toks, probs


@torch.no_grad()
def propose(drafter, context: torch.Tensor, lengths: list[int], last: list[int],
            temperature: float = 0.0, gens=None) -> Proposal:
    """Proposals of every row: ``context`` [m, S_max, k*H] right-padded target features,
    ``lengths`` each row's S (features 0..S-1 are its context), ``last`` the token at S."""
    hidden = _backbone(drafter, context, lengths, last)
    w = drafter.lm_head.weight
    if not getattr(drafter, "anchor_predicts", False):
        logits = drafter.lm_head(hidden[:, 1:].to(w.dtype))  # [m, B-1, V]
        if temperature <= 0:
            return Proposal(logits.argmax(-1), None)
        probs = probabilities(logits, temperature)
        toks = torch.stack([torch.multinomial(probs[i], 1, generator=g)[:, 0]
                            for i, g in enumerate(gens)])
        return Proposal(toks, probs)
    # DSpark: one backbone pass, then the chain (dspark.chain_draft's formula, batched)
    base = F.linear(hidden.to(w.dtype), w)
    base = base.to(torch.promote_types(base.dtype, torch.float32))  # [m, B, V]
    prev = torch.tensor(last, device=context.device, dtype=torch.long)
    head, conf_head = drafter.markov_head, getattr(drafter, "confidence_head", None)
    tokens, probs, confs = [], [], []
    for j in range(drafter.block_size):
        e = head.embed(prev)
        logits = base[:, j] + head.bias(e, w.dtype).to(base.dtype)
        if conf_head is not None:  # chain_draft's: slot j's state and the token before it
            confs.append(torch.sigmoid(conf_head(hidden[:, j], e)))
        prev, p = _pick(logits, temperature, gens)
        tokens.append(prev)
        probs.append(p)
    return Proposal(torch.stack(tokens, 1),
                    torch.stack(probs, 1) if temperature > 0 else None,
                    torch.stack(confs, 1) if confs else None)
