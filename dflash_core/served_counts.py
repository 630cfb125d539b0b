"""Acceptance as vLLM's counters count it (its ``spec_decode`` Prometheus counters), beside
the engine's own count in acceptance.py: what ``eval --engine vllm`` sets side by side and what
``eval`` also reports of its own rounds (docs/eval.md says which is which)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class VllmCounts:
    """Acceptance as vLLM's counters count it (its ``spec_decode`` Prometheus counters): a
    draft for every verification step (``drafts``), ``num_speculative_tokens`` draft tokens each,
    the accepted ones counted whole even in a request's last step, where ``max_tokens`` or a stop
    token cuts the output (so they can pass the tokens the request returned)."""

    drafts: int  # vllm:spec_decode_num_drafts
    draft_tokens: int  # vllm:spec_decode_num_draft_tokens
    accepted: int  # vllm:spec_decode_num_accepted_tokens
    accepted_per_position: list[int]  # vllm:spec_decode_num_accepted_tokens_per_pos

    @classmethod
    def of_rounds(cls, accepted: Sequence[int], per_round: int,
                  proposed: Sequence[int] | None = None) -> "VllmCounts":
        """From each verification round's drafts accepted, counted whole, every round having
        drafted ``per_round`` (spec_decode.RowOutput.served_acceptance), or ``proposed[j]`` in
        round j where given (fewer at the end of the target's window, as vLLM trims them)."""
        per_pos = [sum(1 for a in accepted if a >= k) for k in range(1, per_round + 1)]
        drafted = sum(proposed) if proposed is not None else len(accepted) * per_round
        return cls(len(accepted), drafted, sum(accepted), per_pos)

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's "Mean acceptance length": 1 + accepted / drafts (tau counted its way)."""
        return 1 + self.accepted / self.drafts if self.drafts else 0.0

    @property
    def per_position(self) -> list[float]:
        """vLLM's per-position acceptance rate: accepted at position k / drafts."""
        return [n / self.drafts for n in self.accepted_per_position] if self.drafts else []

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    def record(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted": self.accepted, "accepted_per_position": self.accepted_per_position,
                "mean_acceptance_length": self.mean_acceptance_length,
                "per_position": self.per_position,
                "draft_acceptance_rate": self.draft_acceptance_rate}

    @classmethod
    def from_record(cls, d: dict) -> "VllmCounts":
        return cls(int(d["drafts"]), int(d["draft_tokens"]), int(d["accepted"]),
                   [int(x) for x in d["accepted_per_position"]])

    def __add__(self, other: "VllmCounts") -> "VllmCounts":
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda v: list(v) + [0] * (n - len(v))  # noqa: E731
        return VllmCounts(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                          self.accepted + other.accepted,
                          [a + b for a, b in zip(pad(self.accepted_per_position),
                                                 pad(other.accepted_per_position))])

