"""The engine's state across its runs (observe/events.STATES): the one place it changes, so each
change is published once, as StateChanged, and each run's end once, as RunEnded."""

from __future__ import annotations

import threading
from typing import Any, Callable

from dflash_core.observe.events import RunEnded, StateChanged


class Lifecycle:
    """Made once per engine and lent to each run: the controller reads it, the run's supervisor
    walks it from preflight to the run's end, and the run's first optimizer step ends its
    warm-up."""

    def __init__(self, publish: Callable[[Any], None]):
        self._publish = publish
        self._lock = threading.Lock()
        self.state = "idle"
        self.final_status: str | None = None  # how the last run ended; None before any ended
        self.runs_started = 0  # runs begun (each ends in one RunEnded)
        self.runs_ended = 0  # RunEnded events published

    def enter(self, state: str, reason: str = "") -> None:
        with self._lock:
            prev = self.state
            if prev == state:
                return
            self.state = state
        self._publish(StateChanged(state=state, previous=prev, reason=reason))

    def stepped(self) -> None:
        """An optimizer step ended: the first one ends the warm-up (its kernels compiled)."""
        if self.state == "warmup":
            self.enter("training")

    def end(self, status: str, *, step: int, seconds: float, reason: str) -> None:
        """The run ended in ``status`` (a terminal state), after its teardown."""
        self.final_status = status
        self.enter(status, reason)
        self._publish(RunEnded(status=status, step=step, seconds=seconds, reason=reason))
        self.runs_ended += 1
