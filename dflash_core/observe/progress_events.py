"""The progress of long things a run does before or beside training (part of events.py's
vocabulary): a target's weights or a resumed checkpoint being read, a checkpoint being written in
the background, the demo's target and data being built. Each is progress, not a stall, and ends
with its own last event (done, a Checkpoint, or an Error)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dflash_core.observe.event_base import Event


@dataclass(frozen=True)
class LoadProgress(Event):
    """A load's progress: a target's weights (models/target/load.load_target reports these
    fields but the worker and device), or a checkpoint a resume reads (worker "checkpoint")."""

    worker: str
    device: str
    bytes_loaded: int
    bytes_total: int
    shards_loaded: int
    shards_total: int
    seconds: float
    done: bool = False
    memory_after: int = 0  # bytes allocated on the device once loaded (0 until done)
    kind: ClassVar[str] = "LoadProgress"


@dataclass(frozen=True)
class CheckpointProgress(Event):
    """A checkpoint being written in the background (about once a second): it is progress,
    not a stall. Ends with its Checkpoint event (or an Error)."""

    step: int
    bytes_written: int
    bytes_total: int
    seconds: float  # since it was staged
    reason: str = "periodic"
    kind: ClassVar[str] = "CheckpointProgress"
    sets_state: ClassVar[bool] = False


@dataclass(frozen=True)
class BuildProgress(Event):
    """Something the run builds before it can load (the demo's target, trained on the spot in
    about two minutes on first use, and its data; planning/preflight.py publishes these): how
    far, with the builder's own words ("demo target step 120/600, loss 2.10"). Done at 1.0. At
    most one per whole percent; train.log has a Log line every 10% instead."""

    what: str  # "demo target", "demo data"
    fraction: float  # in [0, 1]
    message: str = ""
    kind: ClassVar[str] = "BuildProgress"
    sets_state: ClassVar[bool] = False  # each replaces the last
    in_text_log: ClassVar[bool] = False

    @property
    def done(self) -> bool:
        return self.fraction >= 1.0
