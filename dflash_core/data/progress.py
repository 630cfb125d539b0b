"""One progress line on stderr for the data commands: done / total, rate, ETA and counters.

On a terminal the line is redrawn in place a few times a second; into a file or a pipe it is written
as a new line every ``every_s`` seconds, so a log stays readable.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def fmt_duration(seconds: float) -> str:
    s = int(max(0, seconds))
    h, m = divmod(s, 3600)
    m, s = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressLine:
    def __init__(self, what: str, total: int | None, unit: str = "rows", *,
                 stream: TextIO | None = None, every_s: float | None = None,
                 enabled: bool = True):
        self.what, self.total, self.unit = what, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s if every_s is not None else (0.2 if self.tty else 5.0)
        self.enabled = enabled
        self.done = 0
        self.start_done = 0  # items already done before this process (a resumed run)
        self.counters: dict[str, int] = {}
        self._t0 = time.monotonic()
        self._last = 0.0
        self._lock = threading.Lock()

    def rate(self) -> float:
        dt = time.monotonic() - self._t0
        return (self.done - self.start_done) / dt if dt > 0 else 0.0

    def line(self) -> str:
        rate = self.rate()
        parts = [f"{self.what}: {self.done}"]
        if self.total:
            parts[0] += f"/{self.total} {self.unit} ({self.done / self.total:.0%})"
        else:
            parts[0] += f" {self.unit}"
        parts.append(f"{rate:.1f} {self.unit}/s")
        if self.total and rate > 0:
            parts.append(f"ETA {fmt_duration((self.total - self.done) / rate)}")
        parts += [f"{k} {v}" for k, v in self.counters.items() if v]
        return ", ".join(parts)

    def update(self, done: int | None = None, add: int = 0, **counters: int) -> None:
        with self._lock:
            self.done = self.done + add if done is None else done
            self.counters.update(counters)
            now = time.monotonic()
            if self.enabled and now - self._last >= self.every_s:
                self._last = now
                self._write()

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def _write(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + self.line())
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._write()
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()
