"""The periodic samples the telemetry thread and the queues publish (part of events.py's
vocabulary): each replaces the one before it, so none sets the dashboard's state or is worth a
line in train.log."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dflash_core.observe.event_base import Event

# Queue names, QueueDepth.name: one prefetch queue per target ("prefetch-0", ...; batches from
# its loader thread) and the hidden-states queue from the targets to the drafters.
HS_QUEUE = "hs"
_PREFETCH = "prefetch"


def prefetch_queue(rank: int) -> str:
    """The name of target ``rank``'s prefetch queue."""
    return f"{_PREFETCH}-{rank}"


def prefetch_rank(name: str) -> int | None:
    """The target rank of a prefetch queue's name; None for any other queue."""
    head, _, tail = name.rpartition("-")
    return int(tail) if head == _PREFETCH and tail.isdigit() else None


@dataclass(frozen=True)
class GpuSample(Event):
    index: int
    name: str
    mem_used: int
    mem_total: int
    util: float = -1.0  # percent, -1 unknown
    temperature: float = -1.0  # celsius, -1 unknown
    power: float = -1.0  # watts, -1 unknown
    torch_allocated: int = 0
    torch_reserved: int = 0
    role: str = ""  # target | drafter | target+drafter | "" unused
    limit: int = 0  # bytes this process may use on the GPU (layout.gpu_memory_gib); 0 = the card
    alloc_retries: int = 0  # caching allocator: times it freed its cache to retry an allocation
    ooms: int = 0  # allocations that failed even so (each one an OutOfMemoryError)
    kind: ClassVar[str] = "GpuSample"
    sets_state: ClassVar[bool] = False
    in_text_log: ClassVar[bool] = False


@dataclass(frozen=True)
class HostSample(Event):
    ram_used: int
    ram_total: int
    cpu_percent: float
    process_rss: int = 0
    kind: ClassVar[str] = "HostSample"
    sets_state: ClassVar[bool] = False
    in_text_log: ClassVar[bool] = False


@dataclass(frozen=True)
class QueueDepth(Event):
    name: str  # prefetch_queue(rank) ("prefetch-0", ...) or HS_QUEUE ("hs")
    depth: int
    capacity: int
    kind: ClassVar[str] = "QueueDepth"
    sets_state: ClassVar[bool] = False
    in_text_log: ClassVar[bool] = False
