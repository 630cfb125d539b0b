"""Samples longer than ``max_length``: cut to their first ``max_length`` tokens, and where.

``data prepare --max-length L`` keeps a long conversation whole up to L tokens, the cut a run
makes at ``data.max_length`` (batching.collate keeps a sample's first tokens), instead of leaving
it out: the answers before the cut still train. A cut sample with nothing trained before the cut
is left out (``too_long``). Each cut is counted: how many, the tokens and trained tokens past the
cut, and where it fell: inside an answer (the tokens on both sides of the cut are trained: the
answer ends early) or in a prompt (the text around the answers: a user or system turn, a tool
result, the template's own words).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Cut:
    length: int  # the sample's tokens before the cut was made
    lost: int  # tokens past the cut
    trained_lost: int  # of which trained
    in_answer: bool  # the cut splits an answer


def cut_sample(ids: np.ndarray, mask: np.ndarray, max_length: int
               ) -> tuple[np.ndarray, np.ndarray, Cut | None]:
    """The sample's first ``max_length`` tokens and the Cut made (None: it fits, or no limit)."""
    n = len(ids)
    if not max_length or n <= max_length:
        return ids, mask, None
    cut = Cut(length=n, lost=n - max_length, trained_lost=int(mask[max_length:].sum()),
              in_answer=bool(mask[max_length - 1] and mask[max_length]))
    return ids[:max_length], mask[:max_length], cut


def first_answer(mask: np.ndarray) -> int:
    """The position of the first trained token (-1: none)."""
    at = np.flatnonzero(mask)
    return int(at[0]) if at.size else -1


@dataclass
class CutCounts:
    """The cuts of a prepare, summed over the samples kept."""

    samples: int = 0
    in_answer: int = 0
    tokens_lost: int = 0
    trained_lost: int = 0
    longest: int = 0

    def add(self, cut: Cut | None) -> None:
        if cut is None:
            return
        self.samples += 1
        self.in_answer += cut.in_answer
        self.tokens_lost += cut.lost
        self.trained_lost += cut.trained_lost
        self.longest = max(self.longest, cut.length)

    def summary(self, max_length: int, tokens: int, trained: int) -> dict:
        """The manifest's entry; ``tokens`` / ``trained``: what the kept samples hold after
        their cuts (the shares are of what they held before)."""
        return {
            "max_length": max_length, "samples": self.samples,
            "in_answer": self.in_answer, "in_prompt": self.samples - self.in_answer,
            "tokens_lost": self.tokens_lost, "trained_tokens_lost": self.trained_lost,
            "tokens_lost_share": round(self.tokens_lost / max(1, tokens + self.tokens_lost), 4),
            "trained_lost_share": round(self.trained_lost / max(1, trained + self.trained_lost),
                                        4),
            "longest": self.longest,
        }


def describe(cut: dict) -> str:
    """One line saying how many samples were cut, where, and what was lost ('' when none)."""
    if not cut.get("samples"):
        return ""
    return (f"cut {cut['samples']} samples to their first {cut['max_length']} tokens (the "
            f"longest had {cut['longest']}): {cut['in_answer']} inside an answer, "
            f"{cut['in_prompt']} in a prompt; {cut['tokens_lost']} tokens lost "
            f"({cut['tokens_lost_share']:.1%} of the tokens), {cut['trained_tokens_lost']} of "
            f"them trained ({cut['trained_lost_share']:.1%} of the trained tokens)")
