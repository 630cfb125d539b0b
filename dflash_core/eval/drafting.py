"""One round's proposals for several prompts, as the decoding loop asks for them.

Each family drafts a batch itself (``draft_batch`` of DFlashDrafter and DSparkDrafter, one
drafter forward for every row: models/proposal.py), and says how many tokens a round drafts
(``drafts_per_round``). A drafter that drafts one context at a time (``draft(context, last,
n)``: the public reference implementation in check, test stubs) is asked row by row, greedy.
"""

from __future__ import annotations

import torch

from dflash_core.models.proposal import Proposal

__all__ = ["Proposal", "drafts_per_round", "propose", "propose_each", "records_confidence"]


def drafts_per_round(drafter, block_size: int) -> int:
    """Tokens a round proposes at ``block_size`` (the drafter's answer: B-1 for DFlash, B for
    DSpark, whose anchor slot predicts); B-1 for a one-context drafter; block size 1, or no
    drafter, is plain decoding."""
    if block_size <= 1 or drafter is None:
        return 0
    own = getattr(drafter, "drafts_per_round", None)
    return own(block_size) if own is not None else block_size - 1


def records_confidence(drafter) -> bool:
    """Whether a round records its drafts' confidences (a drafter with a confidence head)."""
    return getattr(drafter, "confidence_head", None) is not None


def batched(drafter) -> bool:
    """Whether the drafter drafts a batch itself (``draft_batch``)."""
    return hasattr(drafter, "draft_batch")


@torch.no_grad()
def propose(drafter, context: torch.Tensor, lengths: list[int], last: list[int],
            temperature: float = 0.0, gens=None) -> Proposal:
    """Proposals of every row: ``context`` [m, S_max, k*H] right-padded target features,
    ``lengths`` each row's S (features 0..S-1 are its context), ``last`` the token at S."""
    return drafter.draft_batch(context, lengths, last, temperature, gens)


@torch.no_grad()
def propose_each(drafter, context: torch.Tensor, lengths: list[int], last: list[int],
                 counts: list[int]) -> Proposal:
    """A one-context drafter's greedy proposals, row by row: ``counts[i]`` tokens for row i
    (the rows padded with -1 to the longest)."""
    rows = [[int(t) for t in drafter.draft(context[i:i + 1, :S], t, n).reshape(-1).tolist()][:n]
            for i, (S, t, n) in enumerate(zip(lengths, last, counts))]
    width = max(map(len, rows))
    return Proposal(torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long),
                    None)
