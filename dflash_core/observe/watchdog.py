"""Stalls are shown, not guessed: every worker reports progress as it goes (a layer batch, a
micro-group, a batch read, a load chunk, a wait slice), and a watchdog thread publishes a Stall
event for a worker that has gone quiet for longer than several times its own usual interval (never
less than a floor): which worker, its phase, for how long, and where it is now, read from its
thread's Python stack. Progress clears it. A stall is never fatal by itself: a compile may take
minutes; it is only never silent.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from dflash_core.observe.events import Stall

STALL_FACTOR = 5.0  # silent for this many times the worker's own usual interval...
CHECK_EVERY_S = 1.0
STACK_FRAMES = 12  # frames kept in a Stall's stack (innermost last)

# What a stack says a thread is doing, by the first marker found from the innermost frame out.
# (label, path fragments, function names)
ACTIVITIES = (
    ("compiling", ("torch/_inductor", "torch/_dynamo", "torch/_functorch", "triton/compiler"), ()),
    # nodes.py, node_join.py: the engine's own wait loops around collectives across nodes
    ("in a collective", ("torch/distributed", "dflash_core/multinode/nodes.py",
                         "dflash_core/multinode/node_join.py"), ()),
    ("waiting on the GPU", (), ("synchronize", "item", "tolist", "cpu")),
    ("reading", ("pyarrow", "safetensors", "/data/shards.py", "/data/batching.py"),
     ("read", "readinto", "load_file")),
    ("writing a checkpoint", ("dflash_core/checkpoint/",), ()),  # any of its modules
    ("waiting on a queue", (), ("wait",)),
)


@dataclass
class _Beat:
    thread: threading.Thread
    phase: str
    last: float
    interval: float = 0.0  # moving average of the time between beats
    stalled_since: float | None = None
    note: str = ""  # what it waits on, when the worker knows (e.g. which node); cleared by a beat


@dataclass
class Heartbeats:
    """Each worker's last sign of progress. Workers call ``beat`` from their own thread."""

    _beats: dict[str, _Beat] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def beat(self, phase: str | None = None) -> None:
        """The calling thread made progress (``phase``: what it does now, when that changed)."""
        t = threading.current_thread()
        now = time.monotonic()
        with self._lock:
            b = self._beats.get(t.name)
            if b is None or b.thread is not t:
                self._beats[t.name] = _Beat(t, phase or "", now)
                return
            gap = now - b.last
            b.interval = gap if b.interval == 0 else 0.8 * b.interval + 0.2 * gap
            b.last = now
            b.note = ""
            if phase is not None:
                b.phase = phase

    def note(self, text: str) -> None:
        """What the calling thread waits on now, for its Stall report; not progress."""
        with self._lock:
            b = self._beats.get(threading.current_thread().name)
            if b is not None and b.thread is threading.current_thread():
                b.note = text

    def items(self) -> list[tuple[str, _Beat]]:
        with self._lock:
            return list(self._beats.items())


def where(frames: list[traceback.FrameSummary]) -> str:
    """A short account of what a stack is doing: an activity (from ACTIVITIES) and the innermost
    frame of the engine's own code (else of any code outside libraries), e.g.
    "compiling: torch/_inductor/... (drafter_stage.py:62 _accumulate_step)"."""
    own = next((f for f in reversed(frames) if "dflash_core" in f.filename), None) or next(
        (f for f in reversed(frames)
         if "site-packages" not in f.filename and "/lib/python" not in f.filename), None)
    here = f" ({own.filename.rsplit('/', 1)[-1]}:{own.lineno} {own.name})" if own else ""
    for f in reversed(frames):
        path = f.filename.replace("\\", "/")
        for label, paths, names in ACTIVITIES:
            if any(p in path for p in paths) or f.name in names:
                return f"{label}: {_short(path)}:{f.lineno} {f.name}{here}"
    last = frames[-1] if frames else None
    return (f"running: {_short(last.filename)}:{last.lineno} {last.name}" if last else "unknown") \
        + here


def _short(path: str) -> str:
    for root in ("site-packages/", "dflash_core/", "lib/python"):
        if root in path:
            return path.split(root, 1)[1]
    return path.rsplit("/", 2)[-1]


def thread_stack(thread: threading.Thread) -> list[traceback.FrameSummary]:
    frame = sys._current_frames().get(thread.ident)  # the engine owns its threads
    return traceback.extract_stack(frame) if frame is not None else []


def format_stack(frames: list[traceback.FrameSummary]) -> str:
    return "".join(traceback.format_list(frames[-STACK_FRAMES:])).rstrip()


class Watchdog:
    """Runs in a guarded engine thread until ``stop`` is set."""

    def __init__(self, heartbeats: Heartbeats, publish: Callable[[Any], None],
                 stop: threading.Event, floor_s: float):
        self.heartbeats, self.publish, self.stop, self.floor_s = heartbeats, publish, stop, floor_s

    def run(self) -> None:
        while not self.stop.wait(CHECK_EVERY_S):
            self.heartbeats.beat("watching")
            self.check()
        self.check()  # a worker that went on before the run ended: its stall is over

    def check(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for name, b in self.heartbeats.items():
            silent = now - b.last
            limit = max(self.floor_s, STALL_FACTOR * b.interval)
            if b.stalled_since is None and silent > limit and b.thread.is_alive():
                b.stalled_since = b.last
                frames = thread_stack(b.thread)
                here = where(frames) + (f"; {b.note}" if b.note else "")
                self.publish(Stall(worker=name, phase=b.phase, seconds=silent,
                                   where=here, stack=format_stack(frames)))
            elif b.stalled_since is not None and b.last > b.stalled_since:
                b.stalled_since = None
                self.publish(Stall(worker=name, phase=b.phase, seconds=0.0, where="",
                                   stack="", cleared=True))
