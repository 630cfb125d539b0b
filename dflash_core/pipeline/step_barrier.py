"""Where the drafter threads (drafter_stage.py) meet at each optimizer step."""

from __future__ import annotations

import threading


class StepBarrier:
    """Lets drafter threads meet at each optimizer step; the last one to arrive runs the reduce.
    Waits in short slices so an abort (``stop`` set) releases everyone within a fraction of a
    second instead of leaving threads blocked."""

    def __init__(self, parties: int, stop: threading.Event):
        self.parties = parties
        self.stop = stop
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self.result = None

    def arrive(self, action) -> bool:
        """Returns True once the step is done, False if stopped while waiting."""
        with self._cond:
            gen = self._generation
            self._arrived += 1
            if self._arrived == self.parties:
                self.result = action()
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
                return True
            while gen == self._generation:
                if self.stop.is_set():
                    return False
                self._cond.wait(0.1)
            return True
