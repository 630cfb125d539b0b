"""What the dashboard's own controllers share: they run no engine, they publish events that come
from elsewhere (a recorded list for ``--replay``, a followed events.jsonl for ``--attach``) and keep
the run's state from those events."""

from __future__ import annotations

import threading
from typing import Callable

from dflash_core.observe import events as ev
from dflash_core.observe.bus import EventBus


class StreamController:
    """Base of ReplayController and FollowController: the bus, the state, the commands received,
    and the one thread that publishes."""

    detach_on_quit = False  # see dflash_core.pipeline.control.Controller
    final_status: str | None = None  # it runs no run of its own: nothing ended here
    failure: ev.Error | None = None

    def __init__(self) -> None:
        self.bus = EventBus()
        self.calls: list[str] = []  # the commands received, in order (tests read them)
        self._state = "idle"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> str:
        return self._state

    def stuck_workers(self) -> list[str]:
        return []  # no worker of a run runs in this process

    def publish(self, event: ev.Event) -> None:
        self._state = ev.state_after(self._state, event)
        self.bus.publish(event)

    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        """Publish from ``target`` on a thread of its own; it ends when ``_stop`` is set."""
        self._stop.clear()
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def _halt(self, timeout: float = 5.0) -> None:
        """Stop the publishing thread and wait for it (unless called from it)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
