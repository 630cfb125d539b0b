"""What a drafter hands the decoding loop for a batch of prompts (``draft_batch`` of each family),
and the pieces every family drafts with.

A batch is right-padded target features ``context`` [m, S_max, k*H], each row's length S_i (its
features 0..S_i-1 are its context) and the token at S_i. Row i's block ``[token, MASK x (B-1)]``
sits at positions ``S_i .. S_i+B-1`` and sees context positions before ``S_i`` only, so rows of
different lengths share one drafter forward and each gets what drafting it alone gets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    tokens: torch.Tensor  # [m, D] long: D = drafts a round proposes
    probs: torch.Tensor | None  # [m, D, V] float32: each draft's distribution (sampled only)
    confidences: torch.Tensor | None = None  # [m, D]: a confidence head's, when there is one
    logits: torch.Tensor | None = None  # [m, D, V]: what each draft was chosen from (probes)


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32, over the last axis."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def pick(logits: torch.Tensor, temperature: float,
         gens) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows' tokens [m] from logits [m, V]: argmax, or one draw per row with its generator."""
    if temperature <= 0:
        return logits.argmax(-1), None
    probs = probabilities(logits, temperature)
    toks = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0]
                        for i, g in enumerate(gens)])
    return toks, probs


def block_states(drafter, context: torch.Tensor, lengths: list[int],
                 last: list[int]) -> torch.Tensor:
    """Final-normed block states [m, B, H] of each row's block at its anchor (the forward
    training runs)."""
    m, B, dev = context.shape[0], drafter.block_size, context.device
    anchors = torch.tensor(lengths, device=dev, dtype=torch.long)[:, None]
    ids = torch.full((m, B), drafter.mask_token_id, dtype=torch.long, device=dev)
    ids[:, 0] = torch.tensor(last, device=dev, dtype=torch.long)
    pos = anchors + torch.arange(B, device=dev)
    embeds = drafter.embed_tokens(ids).to(drafter.fc.weight.dtype)
    return drafter(context, embeds, pos, anchors)
