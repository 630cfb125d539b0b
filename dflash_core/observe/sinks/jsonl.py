"""events.jsonl: every event as one JSON line, replayable with ``events.read_jsonl``."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from dflash_core.observe.events import Event


class JsonlSink:
    """Append each event to ``path`` as one line.

    Append mode so a resumed run continues the same file. Each line is flushed at once (a reader
    tailing the file sees it); fsync is rate-limited because it costs milliseconds on a busy disk.
    """

    def __init__(self, path: str | os.PathLike, fsync_every_s: float = 1.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync_every_s = fsync_every_s
        self._lock = threading.Lock()  # close() may come from another thread than the bus's
        self._file = open(self.path, "a", encoding="utf-8")
        self._last_sync = time.monotonic()
        self._torn_tail_fix()

    def _torn_tail_fix(self) -> None:
        # A previous process killed mid-write may have left a line without its newline; start on
        # a fresh line so our first event is not glued onto the torn one.
        if self._file.tell() == 0:
            return
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                self._file.write("\n")

    def __call__(self, event: Event) -> None:
        line = event.to_json()
        with self._lock:
            if self._file is None:
                return
            self._file.write(line + "\n")
            self._file.flush()
            now = time.monotonic()
            if now - self._last_sync >= self._fsync_every_s:
                os.fsync(self._file.fileno())
                self._last_sync = now

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            f, self._file = self._file, None
            try:
                f.flush()
                os.fsync(f.fileno())
            finally:
                f.close()
