"""A Controller for a run owned by another process: ``dflash-tui attach RUN_DIR``.

Events come from the run's ``events.jsonl``, followed as it grows (the engine flushes one JSON line
per event); abort and restart go to the owning process as command files
(``dflash_core.pipeline.inbox``). Quitting the dashboard detaches: the run goes on.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from dflash_core.observe import event_log
from dflash_core.observe import events as ev
from dflash_core.observe.event_log import last_run_offset, line_start, state_lines
from dflash_core.pipeline.inbox import send_command

from .stream import StreamController

POLL_S = 0.2
PICKUP_S = 3.0  # a command file still there after this: the owner is not reading commands
# A run of days writes hundreds of MB of events (GPU samples, queue depths). Attaching reads the
# last TAIL_BYTES in full and, before that, only the events that set the dashboard's state (not
# its history: Event.sets_state), so it takes seconds whatever the run's age.
TAIL_BYTES = 16 << 20
KEEP_LOGS = 200  # Log lines kept from before the tail
_state_lines = state_lines  # the name the block search had here


class FollowController(StreamController):
    detach_on_quit = True  # the app quits without asking: nothing of the run stops

    def __init__(self, run_dir: str | Path, *, poll_s: float = POLL_S,
                 pickup_s: float = PICKUP_S, tail_bytes: int = TAIL_BYTES) -> None:
        super().__init__()
        self.events_path = event_log.events_path(run_dir)
        self.run_dir = self.events_path.parent
        self.poll_s, self.pickup_s, self.tail_bytes = poll_s, pickup_s, tail_bytes

    # -- following -----------------------------------------------------------------------------
    def start(self) -> None:
        self.calls.append("start")
        if self._thread is not None and self._thread.is_alive():
            return
        self._start_thread(self._follow, "follow")

    def _follow(self) -> None:
        first = True
        while not self._stop.is_set():
            while not self.events_path.exists():
                if self._stop.wait(self.poll_s):
                    return
            with open(self.events_path, "rb") as f:
                partial = [""]  # a line still being written, completed by a later read
                for event in self._backlog(f, partial):
                    self.publish(event)
                self.publish(ev.Log(level="info", source="attach", message=(
                    f"attached to {self.run_dir} (following events.jsonl; q detaches, the run "
                    f"goes on)" if first else f"{self.events_path} was replaced: following the "
                    f"new file")))
                first = False
                while not self._stop.wait(self.poll_s):
                    for event in self._events(self._complete_lines(f, partial)):
                        self.publish(event)
                    if self._replaced(f):
                        break  # the run folder was cleared and a new run began: start over

    def _replaced(self, f) -> bool:
        """The path now names another file (deleted and written anew), or this one shrank."""
        try:
            now = os.stat(self.events_path)
        except FileNotFoundError:
            return False  # gone for now: keep the open file until a new one appears
        mine = os.fstat(f.fileno())
        return (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev) or now.st_size < f.tell()

    def _backlog(self, f, partial: list[str]) -> list[ev.Event]:
        """The last run's events so far; an unfinished last line is left in ``partial``."""
        f.seek(0, 2)
        size = f.tell()
        start = last_run_offset(f, size)
        tail = max(start, size - self.tail_bytes)
        out: list[ev.Event] = []
        if tail > start:
            tail = line_start(f, tail)  # the tail begins with a whole line
            lines, skipped = state_lines(f, start, tail)
            log = event_log.kind_marker("Log")
            logs = [x for x in lines if log in x[1]]
            head = sorted([x for x in lines if log not in x[1]] + logs[-KEEP_LOGS:])
            out = self._events(r.decode("utf-8", "replace") for _, r in head)
            out.append(ev.Log(level="info", source="attach", message=(
                f"attached to a long run: {skipped} metric lines before the last "
                f"{self.tail_bytes / 2**20:.0f} MB of events.jsonl were skipped; errors, states, "
                f"checkpoints and evaluations are all shown"),
                ts=out[-1].ts if out else time.time()))
        f.seek(tail)
        return out + self._events(self._complete_lines(f, partial))

    @staticmethod
    def _complete_lines(f, partial: list[str]) -> list[str]:
        """New whole lines since the last read; a line still being written waits for its end."""
        chunk = f.read()
        if not chunk:
            return []
        text = partial[0] + chunk.decode("utf-8", "replace")
        lines = text.split("\n")
        partial[0] = lines.pop()  # "" when the chunk ended with a newline
        return [line for line in lines if line.strip()]

    def _events(self, lines) -> list[ev.Event]:
        """Parsed events; an unreadable line is reported and skipped."""
        out = []
        for line in lines:
            try:
                out.append(event_log.parse(line))
            except event_log.UNREADABLE as exc:
                self.publish(ev.Log(level="warning", source="attach",
                                    message=f"skipped an unreadable events.jsonl line: {exc}"))
        return out

    # -- commands ------------------------------------------------------------------------------
    def _send(self, command: str) -> None:
        self.calls.append(command)
        try:
            path = send_command(self.run_dir, command)
        except OSError as exc:
            self.publish(ev.Error(error_kind="io", source="attach", fatal=False,
                                  message=f"could not send {command}: {exc}",
                                  hint=f"check that {self.run_dir} is writable by you"))
            return
        self.publish(ev.Log(level="info", source="attach",
                            message=f"sent {command} to the process that owns the run"))
        threading.Thread(target=self._check_pickup, args=(command, path), name="attach-pickup",
                         daemon=True).start()

    def _check_pickup(self, command: str, path: Path) -> None:
        deadline = time.monotonic() + self.pickup_s
        while time.monotonic() < deadline:
            if not path.exists() or self._stop.is_set():
                return
            time.sleep(0.05)
        path.unlink(missing_ok=True)  # never acted on later by a process that was not there
        self.publish(ev.Error(
            error_kind="internal", source="attach", fatal=False,
            message=f"{command} was not picked up within {self.pickup_s:.0f} s",
            hint="the process that owns the run is not reading commands: it has ended, or its "
                 "run is between runs; check it with ps, or stop it with kill -INT <pid>"))

    def abort(self) -> None:
        self._send("abort")

    def restart(self) -> None:
        self._send("restart")

    def stacks(self) -> None:
        self._send("stacks")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Detach: stop following. The run is not touched."""
        self.calls.append("shutdown")
        self._halt(timeout)
        self.bus.close(timeout)
