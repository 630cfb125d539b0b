"""events.jsonl, a run's event log: the one module that writes it, reads it back and finds its
way in it. The sink (``sinks/jsonl.py``), replay, attach and the report all go through here.

The format: one event per line, ``Event.to_json()`` (compact separators, the type tag ``"event"``
as the last key). ``kind_of`` and ``kind_marker`` rely on that layout to see a line's kind without
parsing it. A file may hold several runs, each beginning with its ``RunStarted`` (a resumed run
appends to the same file); ``last_run_offset`` finds the last one by reading backwards. A process
killed mid-write leaves a torn last line: readers skip it, and the next writer starts a fresh line.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable, Collection, Iterator

from dflash_core.observe import events as ev

EVENTS_FILE = "events.jsonl"
_KIND_TAG = '"event":'
# What a line that does not parse raises: not JSON, an unknown kind, a missing or odd field.
UNREADABLE = (ValueError, KeyError, TypeError, AttributeError)


def events_path(path: str | os.PathLike) -> Path:
    """The events.jsonl of a run folder, or ``path`` itself when it names the file (an existing
    file, or any name ending in .jsonl)."""
    path = Path(path)
    return path if path.is_file() or path.suffix == ".jsonl" else path / EVENTS_FILE


# -- writing ------------------------------------------------------------------------------------
class EventLogWriter:
    """Append each event to ``path`` as one line; called with an event (a bus subscriber).

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

    def __call__(self, event: ev.Event) -> None:
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


# -- peeking ------------------------------------------------------------------------------------
def kind_marker(kind: str) -> bytes:
    """The bytes every line of an event of ``kind`` holds: a block of the file can be searched
    for them without splitting it into lines."""
    return f'{_KIND_TAG}"{kind}"'.encode()


def kind_of(line: str) -> str | None:
    """The event kind a line names ("event" is its last key), without parsing it; None when the
    line does not say (a damaged line: parse it to find out)."""
    tag = line.rfind(_KIND_TAG)
    if tag < 0:
        return None
    start = line.find('"', tag + len(_KIND_TAG)) + 1
    end = line.find('"', start)
    return line[start:end] if start and end > 0 else None


# -- reading ------------------------------------------------------------------------------------
def parse(line: str) -> ev.Event:
    """One line back into its event; raises one of ``UNREADABLE`` when it is not one."""
    return ev.from_json(line)


def read_events(path: str | os.PathLike) -> list[ev.Event]:
    """Every event of a file (all its runs); torn or damaged lines are skipped."""
    out: list[ev.Event] = []
    with open(events_path(path), encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(parse(line))
            except UNREADABLE:
                continue
    return out


def read_last_run(path: str | os.PathLike, kinds: Collection[str] | None = None,
                  on_unreadable: Callable[[str], None] | None = None) -> Iterator[ev.Event]:
    """The events of the file's last run, streamed (a multi-day file is never held in memory).

    ``kinds``: only events of these kinds are parsed; other lines are passed over by their kind
    alone. ``on_unreadable(line)``: called for each line that does not parse (a torn last line
    of a running or killed run). Lines appended while it reads are left out.
    """
    with open(events_path(path), "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(last_run_offset(f, size))
        while f.tell() < size:
            raw = f.readline()
            if not raw:
                break
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            if kinds is not None:
                kind = kind_of(line)
                if kind is not None and kind not in kinds:
                    continue
            try:
                event = parse(line)
            except UNREADABLE:
                if on_unreadable is not None:
                    on_unreadable(line)
                continue
            yield event


# -- finding the way ----------------------------------------------------------------------------
def last_run_offset(f: BinaryIO, size: int, chunk: int = 1 << 20) -> int:
    """Byte offset of the line holding the file's last RunStarted (0 when there is none). Reads
    backwards in chunks, so only the last run's part of the file is touched."""
    marker = kind_marker("RunStarted")
    end, carry = size, b""
    while end > 0:
        start = max(0, end - chunk)
        f.seek(start)
        block = f.read(end - start) + carry  # carry: a marker cut by the chunk edge
        hit = block.rfind(marker)
        if hit >= 0:
            return line_start(f, start + hit)
        carry, end = block[: len(marker)], start
    return 0


def line_start(f: BinaryIO, pos: int) -> int:
    """Start of the line holding byte ``pos``."""
    while pos > 0:
        start = max(0, pos - (1 << 16))
        f.seek(start)
        nl = f.read(pos - start).rfind(b"\n")
        if nl >= 0:
            return start + nl + 1
        pos = start
    return 0


def state_lines(f: BinaryIO, start: int, end: int,
                block: int = 8 << 20) -> tuple[list[tuple[int, bytes]], int]:
    """(offset, line) of every state-setting event (``Event.sets_state``) in [start, end), which
    holds whole lines, and how many other lines there were. Searches blocks for the rare markers
    instead of reading line by line: a 1.5 GB stretch takes seconds."""
    markers = [kind_marker(kind) for kind, cls in ev.EVENT_TYPES.items() if cls.sets_state]
    found: dict[int, bytes] = {}
    total = 0
    pos = start
    while pos < end:
        f.seek(pos)
        blk = f.read(min(block, end - pos))
        cut = blk.rfind(b"\n") + 1
        if cut == 0:  # one line longer than a block: take it whole
            blk = blk + f.readline()
            cut = len(blk)
        blk = blk[:cut]
        total += blk.count(b"\n")
        for m in markers:
            i = blk.find(m)
            while i >= 0:
                ls = blk.rfind(b"\n", 0, i) + 1
                le = blk.find(b"\n", i)
                found[pos + ls] = blk[ls:le]
                i = blk.find(m, le)
        pos += cut
    return sorted(found.items()), total - len(found)
