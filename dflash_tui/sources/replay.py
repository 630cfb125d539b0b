"""A Controller that plays back recorded events instead of running an engine.

Used by the tests (scripted event lists) and by `dflash-tui replay EVENTS_OR_RUN_DIR` for post-mortems of an
events.jsonl. abort / restart / shutdown are recorded in `calls` and answered with a StateChanged,
so the dashboard's controls can be exercised without a GPU.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterable

from dflash_core.observe import event_log
from dflash_core.observe import events as ev

from .stream import StreamController


class ReplayController(StreamController):
    def __init__(self, events: Iterable[ev.Event] | str | Path = (), *, delay: float = 0.0,
                 speed: float = 0.0, shutdown_gate: threading.Event | None = None) -> None:
        """`events`: a list of events or the path of an events.jsonl.
        `delay`: seconds between events; `speed`: instead follow the recorded timestamps, sped up
        this many times (gaps capped at 2 s). With neither, start() publishes everything at once.
        `shutdown_gate`: shutdown() blocks until it is set (or its timeout), standing in for an
        engine whose workers take a while to stop."""
        super().__init__()
        if isinstance(events, (str, Path)):
            events = event_log.read_events(events)
        self.events: list[ev.Event] = list(events)
        self.delay, self.speed, self.shutdown_gate = delay, speed, shutdown_gate
        self._last_ts: float | None = None

    @classmethod
    def from_jsonl(cls, path: str | Path, **kwargs) -> "ReplayController":
        return cls(path, **kwargs)

    def publish(self, event: ev.Event) -> None:
        self._last_ts = event.ts
        super().publish(event)

    def start(self) -> None:
        self.calls.append("start")
        if not self.delay and not self.speed:
            for e in self.events:
                self.publish(e)
            return
        self._start_thread(self._play, "replay")

    def _play(self) -> None:
        prev = None
        for e in self.events:
            wait = self.delay or (min(2.0, max(0.0, e.ts - prev) / self.speed) if prev else 0.0)
            if self._stop.wait(wait):
                return
            prev = e.ts
            self.publish(e)

    def _change(self, state: str, reason: str) -> None:
        # Keep event time consistent with what was replayed, so elapsed does not jump to "now".
        ts = self._last_ts if self._last_ts is not None else time.time()
        self.publish(ev.StateChanged(state=state, previous=self._state, reason=reason, ts=ts))

    def abort(self) -> None:
        self.calls.append("abort")
        self._halt()
        if self._state not in ev.TERMINAL_STATES:
            self._change("aborted", "abort requested")

    def restart(self) -> None:
        self.calls.append("restart")
        self._halt()
        self._change("preflight", "restart requested")

    def stacks(self) -> None:
        self.calls.append("stacks")
        self.publish(ev.Log(level="info", source="replay", ts=self._last_ts or time.time(),
                            message="a recorded run has no live threads to show"))

    def shutdown(self, timeout: float = 30.0) -> None:
        self.calls.append("shutdown")
        self._halt()
        if self.shutdown_gate is not None:
            self.shutdown_gate.wait(timeout)
        if self._state not in ev.TERMINAL_STATES and self._state != "idle":
            self._change("aborted", "shutdown")
        self.bus.close(timeout)
