"""The sizes that fix an out-of-memory error, as one vocabulary.

Each lever is a config key, what it sizes, what lowering it costs, and (for those preflight may
lower itself) its floor. Three places speak of them: the hint of an out-of-memory error
(observe/errors.py: the keys of the role that ran out), the memory plan (planning/memory.py:
which key shrinks which part of a GPU's peak, and the sizes that would fit), and the trainer
after an out-of-memory step (models/training/replica.py: a smaller micro-group). They all lower a size by
the one rule of ``halve``.

It sits beside config.py, below every layer that names a lever (observe, models, planning), and
importing it does not import torch (error hints are made where torch may be absent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from dflash_core.anchor_counts import ANCHOR_PAD, anchors_for
from dflash_core.config import key_value

if TYPE_CHECKING:
    from dflash_core.config import Config

MIN_LOSS_CHUNK = 256  # block tokens: below this the loss's chunks cost more in launches than they save


def halve(value: int, floor: int) -> int | None:
    """The one rule for a smaller size: half of ``value``, not below ``floor``; None when
    ``value`` is at its floor already (nothing smaller to try)."""
    return max(floor, value // 2) if value > floor else None


@dataclass(frozen=True)
class Lever:
    key: str  # the config key
    sizes: str  # what its value counts
    trades: str  # what a smaller value costs
    # The smallest value preflight may lower it to (layout.auto_fit, the sizes that fit); None:
    # preflight never lowers it (it changes what is learned, or is only named in a hint).
    floor: Callable[[Config], int] | None = None
    one_at_a_time: bool = False  # a small count: lowered by one, not halved

    def lower(self, cfg: Config) -> int | None:
        """The next smaller value worth trying, or None at its floor (or for a lever preflight
        does not lower)."""
        if self.floor is None:
            return None
        value, floor = key_value(cfg, self.key), self.floor(cfg)
        if self.one_at_a_time:
            return value - 1 if value > floor else None
        return halve(value, floor)

    def describe(self) -> str:
        return f"{self.key} ({self.sizes})"


def _smallest_pass(cfg: Config) -> int:
    """Block tokens of the smallest drafter pass: one sequence's blocks at data.max_length, or
    ANCHOR_PAD of them when it has more (the replica splits a sequence's anchors into passes;
    fewer than ANCHOR_PAD would give compiled attention a new shape for nothing)."""
    d = cfg.drafter
    blocks = anchors_for(cfg.data.max_length, d.num_anchors, d.anchors_per_1k_tokens)
    return min(blocks, ANCHOR_PAD) * d.block_size


TOKEN_BUDGET = Lever("data.token_budget", "tokens per target batch",
                     "fewer tokens per batch: more, smaller steps",
                     floor=lambda cfg: cfg.data.max_length)
MAX_SEQS = Lever("data.max_seqs_per_batch", "sequences per target batch",
                 "fewer sequences per batch: more, smaller steps")
HS_QUEUE = Lever("layout.hs_queue", "feature batches waiting for the drafters",
                 "less slack between targets and drafters", floor=lambda cfg: 1,
                 one_at_a_time=True)
PREFETCH = Lever("data.prefetch_batches", "batches each loader keeps ready",
                 "less read-ahead: a slow read shows as a starved target")
MICRO_BLOCK_TOKENS = Lever("drafter.micro_block_tokens", "block tokens per drafter forward",
                           "more, smaller drafter passes per batch (the same gradients, slower)",
                           floor=_smallest_pass)
LOSS_CHUNK = Lever("drafter.loss_chunk", "block tokens per chunk of the loss's logits",
                   "more, smaller loss chunks (the same loss, slower)",
                   floor=lambda cfg: MIN_LOSS_CHUNK)
NUM_ANCHORS = Lever("drafter.num_anchors", "blocks trained per sequence (the most, with "
                    "drafter.anchors_per_1k_tokens)", "fewer blocks learned from each sequence")
NUM_LAYERS = Lever("drafter.num_layers", "drafter layers", "a smaller drafter")
MAX_LENGTH = Lever("data.max_length", "tokens of the longest sample",
                   "longer samples cut shorter: their ends are not learned")

# What to lower when a role runs out of memory while training, the first lever first.
OOM_LEVERS: dict[str, tuple[Lever, ...]] = {
    "target": (TOKEN_BUDGET, MAX_SEQS),
    "drafter": (MICRO_BLOCK_TOKENS, LOSS_CHUNK),
    "loader": (PREFETCH,),
}
# What preflight may lower to make a plan fit, per role, in the order it tries them. Each changes
# speed or batching only, never what is learned (the anchors, layers and block size stay).
FIT_LEVERS: dict[str, tuple[Lever, ...]] = {
    "drafter": (MICRO_BLOCK_TOKENS, LOSS_CHUNK),
    "target": (HS_QUEUE, TOKEN_BUDGET),
}


def oom_advice(role: str) -> str:
    """The keys to lower in config.yaml when ``role`` ran out of memory, with what each sizes."""
    return " or ".join(lever.describe() for lever in OOM_LEVERS.get(role, (TOKEN_BUDGET,)))
