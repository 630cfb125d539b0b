"""The CUDA caching allocator's settings and the per-process card limit.

Expandable segments let the allocator grow one mapping instead of keeping fixed blocks, so memory
freed by one step is reusable by the next whatever its shape: without them a 27B-shaped drafter on
a 96 GB card ran out of memory at step 3 with 5 GiB reserved but unallocated. The setting is read
when CUDA first allocates, so it is made before any engine touches a GPU; a user's own
PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) wins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dflash_core.planning.card_budget import card_budget, limit_bytes

ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # old and new name; either works
DEFAULT_CONF = "expandable_segments:True"


@dataclass(frozen=True)
class AllocatorSetting:
    conf: str  # the settings in force ("" = PyTorch's defaults)
    source: str  # who chose them

    def describe(self) -> str:
        return f"CUDA allocator: {self.conf or 'PyTorch defaults'} ({self.source})"


def configure_allocator() -> AllocatorSetting:
    """Turn on expandable segments for this process unless the user chose settings or CUDA has
    already allocated (then the settings in force cannot change)."""
    for name in ENV_NAMES:
        if os.environ.get(name):
            return AllocatorSetting(os.environ[name], f"from {name}")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return AllocatorSetting("", "CUDA was initialised before dflash could set it")
    os.environ[ENV_NAMES[0]] = DEFAULT_CONF
    return AllocatorSetting(DEFAULT_CONF, f"dflash default; set {ENV_NAMES[0]} to override")


def apply_card_limit(device: torch.device, limit_gib: float) -> int:
    """Cap what this process may allocate on ``device`` at ``limit_gib`` (0: the whole card), so
    a smaller card can be rehearsed on a bigger one. Returns the limit in bytes."""
    total = torch.cuda.get_device_properties(device).total_memory
    limit = card_budget(total, limit_bytes(limit_gib))
    torch.cuda.set_per_process_memory_fraction(limit / total, device)
    return limit
