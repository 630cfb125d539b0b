"""How engine events get from engine threads onto the screen.

Engine threads call `EventBuffer.put` (through `bus.tap`): an append under a lock, never a wait.
The app drains the buffer a few times a second and posts ONE `EngineEvents` message per batch,
however fast the run publishes, so a busy training loop cannot flood the message queue.
"""

from __future__ import annotations

import threading

from textual.message import Message

from dflash_core.observe import events as ev


class EventBuffer:
    """Thread-safe, bounded hand-over from publishers to the UI thread."""

    def __init__(self, limit: int = 200_000) -> None:
        self._items: list[ev.Event] = []
        self._lock = threading.Lock()
        self.limit = limit
        self.dropped = 0  # high-rate samples dropped because the UI fell far behind

    def put(self, event: ev.Event) -> None:
        with self._lock:
            if len(self._items) < self.limit or event.keep_when_behind:
                self._items.append(event)
            else:
                self.dropped += 1

    def __len__(self) -> int:
        return len(self._items)

    def drain(self) -> list[ev.Event]:
        with self._lock:
            items, self._items = self._items, []
        return items


class EngineEvents(Message):
    """A batch of engine events, in publish order."""

    def __init__(self, events: list[ev.Event]) -> None:
        super().__init__()
        self.events = events


class TerminalLost(Message):
    """The terminal refused a write (it hung up); posted from Textual's writer thread."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason
