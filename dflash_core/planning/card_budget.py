"""What one process may use of a GPU: the whole card, or less when ``layout.gpu_memory_gib``
rehearses a smaller card on a bigger one. One rule for the preflight's memory plan, the limit the
allocator enforces and the dashboard's memory bars (imports nothing heavy: the dashboard uses it).
"""

from __future__ import annotations

from dflash_core.units import GiB


def limit_bytes(gpu_memory_gib: float) -> int:
    """``layout.gpu_memory_gib`` in bytes; 0 (or less) = no limit, the whole card."""
    return int(gpu_memory_gib * GiB) if gpu_memory_gib > 0 else 0


def card_budget(total: int, limit: int) -> int:
    """Bytes a process may use on a card of ``total`` bytes under a limit of ``limit`` bytes
    (0 = the whole card); a limit above the card is the card, and where the card's size is
    unknown (``total`` <= 0) the limit is all there is to go by."""
    if limit <= 0:
        return total
    return min(total, limit) if total > 0 else limit
