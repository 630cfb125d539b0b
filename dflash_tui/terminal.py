"""The dashboard's terminal driver: Textual's own, except that a terminal that has gone away
ends the screen instead of freezing it.

Textual draws through one writer thread that writes to the terminal and a queue of 30 writes in
front of it. When the terminal goes (its SSH connection dropped, the program holding the
pseudo-terminal's master killed) the next write fails with EIO, which ends the writer thread;
the queue then fills, and the 31st write blocks the event loop for good. Every handler that
runs on the loop is then dead too: SIGHUP's hang-up, and SIGTERM's abort. Whether the hang-up
ran first (dup'ing the console away from the dead terminal) or the writer hit the dead terminal
first was a race, lost about one time in four. Here a failed write is reported once
(``on_lost``, called from the writer thread, so it must not wait on the loop) and every later
write is dropped: the writer never dies, so the loop never blocks on it, and a terminal that
went away without a SIGHUP (no controlling terminal) is noticed all the same.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class GuardedOutput:
    """The file Textual's writer thread writes to, wrapped: errors become one ``on_lost``."""

    def __init__(self, file: Any, on_lost: Callable[[OSError | ValueError], None]) -> None:
        self._file = file
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self.lost = False

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self._file.write(text)
            except (OSError, ValueError) as exc:  # ValueError: the file was closed
                self._lose(exc)
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._file.flush()
            except (OSError, ValueError) as exc:
                self._lose(exc)

    def _lose(self, exc: OSError | ValueError) -> None:
        with self._lock:
            if self.lost:
                return
            self.lost = True
        self._on_lost(exc)

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self._file, name)


def guarded_driver(base: type, on_lost: Callable[[OSError | ValueError], None]) -> type:
    """``base`` (Textual's Linux driver) writing through a GuardedOutput."""

    class GuardedDriver(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._file = GuardedOutput(self._file, on_lost)

    GuardedDriver.__name__ = GuardedDriver.__qualname__ = f"Guarded{base.__name__}"
    return GuardedDriver
