"""The rows the dashboard's panels draw, as plain records: a GPU, a target worker, a queue, an
error, a log line; which GPU row a device label names, and which rank of a split target.

DashboardState (dashboard.py) keeps them up to date from events and the widgets draw them. They are
apart from the fold because they are data without its rules: a widget's test builds a row
without folding a run.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

from dflash_core.observe import events as ev
from dflash_core.planning.card_budget import card_budget

# A target row's status is its worker's own (ev.WORKER_STATUSES) or one of the dashboard's: no
# WorkerStatus yet, or its weights are loaded and its warmup not reported yet.
TARGET_PENDING = "pending"
TARGET_LOADED = "loaded"


@dataclass
class GpuRow:
    index: int
    name: str = ""
    role: str = ""
    mem_used: int = 0
    mem_total: int = 0
    torch_allocated: int = 0
    torch_reserved: int = 0
    limit: int = 0  # bytes the run may use here (layout.gpu_memory_gib); 0 = the whole card
    alloc_retries: int = 0
    ooms: int = 0
    tight: bool = False  # headroom under TIGHT_HEADROOM or the allocator retrying: warned once
    plan: int = 0  # preflight estimate of the peak, bytes (0 = no plan for this GPU)
    plan_fits: bool = True
    plan_role: str = ""
    util: float = -1.0
    temperature: float = -1.0
    sampled: bool = False  # a GpuSample arrived (plan-only rows have none)

    @property
    def budget(self) -> int:
        """What the run may use here: the card, or the rehearsed smaller card of its limit."""
        return card_budget(self.mem_total, self.limit)


@dataclass
class TargetRow:
    worker: str
    device: str = ""
    # pending | loading | loaded | warmup | running | done | stopped | failed (see TARGET_PENDING)
    status: str = TARGET_PENDING
    detail: str = ""
    bytes_loaded: int = 0
    bytes_total: int = 0
    shards_loaded: int = 0
    shards_total: int = 0
    seconds: float = 0.0
    memory_after: int = 0
    tokens_per_s: float = 0.0
    batches: int = 0
    blocked_frac: float = 0.0
    starved_frac: float = 0.0
    error: str = ""  # why it failed, from an Error whose source is this worker


@dataclass
class QueueRow:
    name: str
    depth: int = 0
    capacity: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=120))


@dataclass
class ErrorEntry:
    event: ev.Error
    previous: bool = False  # from the post-mortem of an earlier run, not counted in the header


@dataclass
class LogLine:
    seq: int
    ts: float
    level: str  # debug | info | warning | error
    source: str
    text: str


# A rank of a target split over several GPUs: "cuda:0 copy 0 rank 0/2" (the device column the
# engine writes, TargetGroup.label in dflash_core/target_group/group.py).
_RANK_LABEL = re.compile(r"^(?P<device>\S+) copy (?P<copy>\d+) rank (?P<rank>\d+)/(?P<ranks>\d+)$")


@dataclass(frozen=True)
class RankLabel:
    device: str  # cuda:0, or cpu:0.1 (copy 0's rank 1 on the CPU)
    copy: int
    rank: int
    ranks: int

    @property
    def words(self) -> list[str]:
        """How a panel says it, fullest first, each shorter: the rank always stays."""
        rank = f"rank {self.rank}/{self.ranks}"
        return [f"{self.device} copy {self.copy} {rank}", f"copy {self.copy} {rank}", rank]


def rank_label(label: str) -> RankLabel | None:
    """The rank a device label names; None for a whole target's ("cuda:3", "cpu:0")."""
    m = _RANK_LABEL.match(str(label))
    if m is None:
        return None
    return RankLabel(m["device"], int(m["copy"]), int(m["rank"]), int(m["ranks"]))


def device_words(label: str) -> list[str]:
    """A device label as a panel may say it, fullest first, down to what must stay: a rank's
    number, or nothing for a whole target's device (the GPUs panel names it)."""
    rank = rank_label(label)
    if rank is not None:
        return rank.words
    return [label, ""] if label else [""]


def device_index(label: str) -> int | None:
    """ "cuda:3" -> 3; anything else (cpu:0, cpu) -> None."""
    kind, _, idx = str(label).partition(":")
    return int(idx) if kind == "cuda" and idx.isdigit() else None
