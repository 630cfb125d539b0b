"""What one process may use of a GPU: the whole card, or less when ``layout.gpu_memory_gib``
rehearses a smaller card on a bigger one; and what each process holds there beyond its tensors. One rule for the preflight's memory plan, the limit the
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


# What a GPU holds beyond the tensors, counted once per CUDA device (not on CPU), so that "fits"
# means planned tensors + this margin <= the memory the process may use. Measured with
# bench/training/pipeline.py on two H200s capped at 95 GiB (torch 2.11, expandable segments, the 27B
# shape of config.yaml, 18 steps; bench/BENCHMARKS.md, "The shipped config on a 96 GB card"):
# - NVML used minus torch reserved (CUDA context, cuBLAS / Triton modules, driver pools):
#   1.3 GiB on the target GPU, 1.8 GiB on the drafter GPU;
# - torch reserved minus torch's peak allocated (the allocator's own slack): 0.9 GiB (1.1%) on
#   the target, 2.7 GiB (3.1%) on the drafter. Without expandable segments the target's slack
#   was 12.9 GiB (16%), which is why the engine turns them on (allocator.py).
CUDA_CONTEXT = 2 * GiB
ALLOCATOR_RESERVE = 0.04  # of the planned tensors
