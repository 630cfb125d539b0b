"""The dashboard's view of the run's prompt sets (eval.prompt_sets): per set, its latest
EvalResult and the exact taus of its evaluations so far, in the order the sets first came. The
held-out evaluation (an EvalResult without a set) is DashboardState's own."""

from __future__ import annotations

from collections import deque

from dflash_core.observe import events as ev

HISTORY = 500  # evaluations kept per set for the panel's small plot
MAX_SETS = 32  # sets past this many are not shown (a config names a few)


class SetEvals:
    def __init__(self) -> None:
        self.latest: dict[str, ev.EvalResult] = {}
        self.taus: dict[str, deque[float]] = {}

    def add(self, e: ev.EvalResult) -> bool:
        """Fold one set's result; False when it is past MAX_SETS (not kept)."""
        name = e.prompt_set
        if name not in self.latest and len(self.latest) >= MAX_SETS:
            return False
        self.latest[name] = e
        self.taus.setdefault(name, deque(maxlen=HISTORY)).append(e.tau)
        return True

    def __bool__(self) -> bool:
        return bool(self.latest)

    def names(self) -> list[str]:
        return list(self.latest)
