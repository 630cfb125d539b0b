"""What a process may use of a GPU: one rule for the plan, the allocator and the dashboard."""

import pytest

from dflash_core.planning.card_budget import card_budget, limit_bytes
from dflash_core.units import GiB


@pytest.mark.parametrize("total, gib, want", [
    (80 * GiB, 0, 80 * GiB),  # 0 = the whole card
    (80 * GiB, 24, 24 * GiB),  # a rehearsed smaller card
    (80 * GiB, 200, 80 * GiB),  # a limit above the card is the card
    (0, 24, 24 * GiB),  # the card's size unknown: the limit
])
def test_the_card_budget(total, gib, want):
    assert card_budget(total, limit_bytes(gib)) == want
