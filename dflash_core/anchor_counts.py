"""How many anchors a sample gets, and how many of its blocks one drafter pass holds.

A count (``drafter.num_anchors`` each) or a density that follows the sample's length
(``drafter.anchors_per_1k_tokens``, capped by the count): with a count of 512, a 2k-token answer
is supervised at a quarter of its positions and a 100k-token one at half a percent; with a
density both are supervised alike. The drafter splits a sequence whose blocks exceed
``drafter.micro_block_tokens`` into passes of fewer anchors each (the same gradients: every block
is its own term of the loss), so a long sample's many anchors fit the card.

Torch-free: the loaders, the batch planner, the memory plan and the levers all ask it.
"""

from __future__ import annotations

import math

# On GPU the anchors of a batch (and of one pass) are padded to a multiple of this, so compiled
# FlexAttention and its block mask see a handful of shapes instead of one per batch.
ANCHOR_PAD = 64


def anchors_for(positions: int, num_anchors: int, per_1k: float = 0.0) -> int:
    """The anchors a sample with ``positions`` valid anchor positions gets: all of them up to
    ``num_anchors``; with a density ``per_1k`` > 0, ceil(per_1k x positions / 1000) (at least
    one), still at most ``num_anchors`` and never more than the positions."""
    positions = max(0, int(positions))
    cap = min(positions, int(num_anchors))
    if per_1k <= 0:
        return cap
    return min(cap, max(1, math.ceil(per_1k * positions / 1000)))


def pass_anchors(micro_block_tokens: int, width: int, block_size: int, pad: int = 1) -> int:
    """Anchors of one sequence that one forward / backward takes: all ``width`` when its blocks
    fit ``micro_block_tokens`` block tokens, else the most that do, rounded down to a multiple
    of ``pad`` (at least ``pad``, never more than ``width``)."""
    if width * block_size <= micro_block_tokens:
        return max(1, width)
    fit = micro_block_tokens // max(1, block_size)
    return max(1, min(width, max(pad, fit // pad * pad)))
