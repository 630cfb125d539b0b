"""Acceptance by context length: every round of exact decoding has a position, the tokens in the
sequence before its drafts (the prompt's and those generated so far, the prefill's one
included), and falls in one bucket of it; each bucket counts its rounds and accepted drafts, and
its tau is (accepted + rounds) / rounds, the exact tau of those rounds alone. A drafter trained
on short samples can hold its tau on short prompts and lose it deep in a long one; one pooled tau
hides that.

The buckets follow the target's window (its max_position_embeddings): the edges are 1k, 4k, 16k
and 64k tokens, those below the window (a bucket past it cannot hold a round); the last bucket
ends at the window. A small window under which fewer than two of them fit (4k or less) has all
four halved until two do, so its decodings still split: 4096 positions give 512 / 2k, 1024 (the
demo's target) 128 / 512.

The record every reader takes (an EvalResult's ``context``, results.json's ``context``): one dict
per bucket, in order, ``{"bucket", "from", "to", "rounds", "accepted", "tau"}`` (``to`` None: no
window known, the last bucket has no end; ``tau`` None: no round there). Shown (the training
panel, train.log, the eval table, the report) only when more than one bucket has rounds: with
one, its tau is the pooled tau. Below every reader, as acceptance.py: imports nothing here but it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Sequence

from dflash_core.acceptance import Measure

DEFAULT_EDGES = (1024, 4096, 16384, 65536)
MIN_EDGES = 2  # a small window keeps at least this many edges (three buckets)

BY_CONTEXT = Measure(
    "context", "tau by context", "eval/tau_by_context",
    "exact tau of the rounds whose position (prompt + tokens generated before the round) falls "
    "in each bucket of tokens, its rounds in brackets")


def edges_for(window: int | None) -> tuple[int, ...]:
    """The bucket edges for a target of ``window`` positions (None or 0: not known: the
    defaults): the defaults below the window; when fewer than MIN_EDGES fit, all halved until
    they do."""
    if not window or window <= 0:
        return DEFAULT_EDGES
    scale = 1
    while True:
        edges = tuple(e // scale for e in DEFAULT_EDGES if 0 < e // scale < window)
        if len(edges) >= MIN_EDGES or DEFAULT_EDGES[0] // scale < 2:
            return edges
        scale *= 2


def tokens_text(n: int) -> str:
    """1024 -> '1k', 40960 -> '40k', 128 -> '128'."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class Buckets:
    edges: tuple[int, ...]
    window: int | None = None  # where the last bucket ends (None: not known)

    @classmethod
    def of(cls, window: int | None) -> "Buckets":
        window = int(window) if window and window > 0 else None
        return cls(edges_for(window), window)

    def __len__(self) -> int:
        return len(self.edges) + 1

    def index(self, position: int) -> int:
        """The bucket of a round at ``position``: an edge's own position opens the next one."""
        return bisect.bisect_right(self.edges, position)

    def bounds(self, j: int) -> tuple[int, int | None]:
        """(from, to) of bucket j: positions from <= p < to (to None: no end)."""
        lo = self.edges[j - 1] if j > 0 else 0
        return lo, (self.edges[j] if j < len(self.edges) else self.window)

    def label(self, j: int) -> str:
        """'0-1k', '1-4k', '16-40k', '128-512', '256-1k', '16k+' (no end known): no spaces and
        no '/', so it is a W&B key's part too."""
        lo, hi = self.bounds(j)
        if hi is None:
            return f"{tokens_text(lo)}+"
        a, b = tokens_text(lo), tokens_text(hi)
        if a.endswith("k") and b.endswith("k"):
            a = a[:-1]
        return f"{a}-{b}"


def buckets_of(target) -> Buckets:
    """The buckets of a loaded target (models/target/model.TargetModel, read by its
    ``text_config``): its max_position_embeddings; the defaults when it has none."""
    text = getattr(target, "text_config", None)
    return Buckets.of(getattr(text, "max_position_embeddings", None))


def round_positions(prompt_len: int, acceptance: Sequence[int]) -> list[int]:
    """Each round's position from the prompt's length and the drafts accepted per round: the
    prefill appends one token, each round its accepted drafts and the target's own. What the
    decoding loop records (spec_decode.RowOutput.positions), for results that kept only the
    acceptance (eval's results files)."""
    out, at = [], prompt_len + 1
    for a in acceptance:
        out.append(at)
        at += a + 1
    return out


class ContextCounts:
    """Rounds and accepted drafts per bucket, added row by row."""

    def __init__(self, buckets: Buckets):
        self.buckets = buckets
        self.rounds = [0] * len(buckets)
        self.accepted = [0] * len(buckets)

    def add(self, positions: Sequence[int], acceptance: Sequence[int]) -> "ContextCounts":
        """One row's rounds: ``positions[r]`` and ``acceptance[r]`` of round r."""
        if len(positions) != len(acceptance):
            raise ValueError(f"{len(positions)} positions for {len(acceptance)} rounds")
        for p, a in zip(positions, acceptance):
            j = self.buckets.index(p)
            self.rounds[j] += 1
            self.accepted[j] += a
        return self

    def records(self) -> list[dict]:
        out = []
        for j in range(len(self.buckets)):
            lo, hi = self.buckets.bounds(j)
            n, a = self.rounds[j], self.accepted[j]
            out.append({"bucket": self.buckets.label(j), "from": lo, "to": hi, "rounds": n,
                        "accepted": a, "tau": (a + n) / n if n else None})
        return out


def by_context(buckets: Buckets, rows: Iterable[tuple[Sequence[int], Sequence[int]]]
               ) -> list[dict]:
    """The record of ``rows``, each (positions, acceptance) of its rounds."""
    counts = ContextCounts(buckets)
    for positions, acceptance in rows:
        counts.add(positions, acceptance)
    return counts.records()


def with_rounds(records: Sequence[dict] | None) -> list[dict]:
    """The buckets that hold a round."""
    return [r for r in (records or []) if r.get("rounds")]


def shown(records: Sequence[dict] | None) -> bool:
    """Whether the record is worth showing: more than one bucket holds rounds."""
    return len(with_rounds(records)) > 1


def bucket_text(r: dict) -> str:
    """'1-4k 2.31 (412)': a bucket's tau and its rounds."""
    return f"{r['bucket']} {r['tau']:.2f} ({r['rounds']})"


def context_line(records: Sequence[dict] | None) -> str:
    """'tau by context 0-1k 2.91 (412) | 1-4k 2.30 (80)'; '' when not shown."""
    if not shown(records):
        return ""
    return f"{BY_CONTEXT.label} " + " | ".join(bucket_text(r) for r in with_rounds(records))


def context_wandb(records: Sequence[dict] | None, prefix: str = "eval/") -> dict[str, float]:
    """W&B values of the buckets with rounds: <prefix>tau_by_context/<bucket> and
    <prefix>rounds_by_context/<bucket> (a set's under eval/<set>/)."""
    key = BY_CONTEXT.wandb.replace("eval/", prefix, 1)
    rounds = key.replace("tau_by_context", "rounds_by_context")
    out: dict[str, float] = {}
    for r in with_rounds(records):
        out[f"{key}/{r['bucket']}"] = r["tau"]
        out[f"{rounds}/{r['bucket']}"] = r["rounds"]
    return out
