"""A Controller for a run owned by another process: ``dflash-tui --attach RUN_DIR``.

Events come from the run's ``events.jsonl``, followed as it grows (the engine flushes one JSON line
per event); abort and restart go to the owning process as command files
(``dflash_core.inbox``). Quitting the dashboard detaches: the run goes on.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from dflash_core import events as ev
from dflash_core.inbox import send_command

POLL_S = 0.2
PICKUP_S = 3.0  # a command file still there after this: the owner is not reading commands


class FollowController:
    detach_on_quit = True  # the app quits without asking: nothing of the run stops

    def __init__(self, run_dir: str | Path, *, poll_s: float = POLL_S,
                 pickup_s: float = PICKUP_S) -> None:
        path = Path(run_dir)
        self.events_path = path if path.name.endswith(".jsonl") else path / "events.jsonl"
        self.run_dir = self.events_path.parent
        self.poll_s, self.pickup_s = poll_s, pickup_s
        self.bus = ev.EventBus()
        self.calls: list[str] = []
        self._state = "idle"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> str:
        return self._state

    def _publish(self, event: ev.Event) -> None:
        if isinstance(event, ev.StateChanged):
            self._state = event.state
        elif isinstance(event, ev.RunEnded):
            self._state = event.status
        self.bus.publish(event)

    # -- following -----------------------------------------------------------------------------
    def start(self) -> None:
        self.calls.append("start")
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._follow, name="follow", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self.events_path.exists():
            if self._stop.wait(self.poll_s):
                return
        with open(self.events_path, encoding="utf-8") as f:
            partial = [""]
            backlog = [e for e in map(self._parse, self._complete_lines(f, partial)) if e]
            # Only the last run in the file: earlier ones (before a restart) are history.
            starts = [i for i, e in enumerate(backlog) if isinstance(e, ev.RunStarted)]
            for event in backlog[starts[-1] if starts else 0:]:
                self._publish(event)
            self._publish(ev.Log(level="info", source="attach", message=(
                f"attached to {self.run_dir} (following events.jsonl; q detaches, the run goes "
                f"on)")))
            while not self._stop.wait(self.poll_s):
                for line in self._complete_lines(f, partial):
                    event = self._parse(line)
                    if event is not None:
                        self._publish(event)

    @staticmethod
    def _complete_lines(f, partial: list[str]) -> list[str]:
        """New whole lines since the last read; a line still being written waits for its end."""
        chunk = f.read()
        if not chunk:
            return []
        text = partial[0] + chunk
        lines = text.split("\n")
        partial[0] = lines.pop()  # "" when the chunk ended with a newline
        return [line for line in lines if line.strip()]

    def _parse(self, line: str) -> ev.Event | None:
        try:
            return ev.from_json(line)
        except (ValueError, KeyError, TypeError) as exc:
            self._publish(ev.Log(level="warning", source="attach",
                                 message=f"skipped an unreadable events.jsonl line: {exc}"))
            return None

    # -- commands ------------------------------------------------------------------------------
    def _send(self, command: str) -> None:
        self.calls.append(command)
        try:
            path = send_command(self.run_dir, command)
        except OSError as exc:
            self._publish(ev.Error(kind_="io", source="attach", fatal=False,
                                   message=f"could not send {command}: {exc}",
                                   hint=f"check that {self.run_dir} is writable by you"))
            return
        self._publish(ev.Log(level="info", source="attach",
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
        self._publish(ev.Error(
            kind_="internal", source="attach", fatal=False,
            message=f"{command} was not picked up within {self.pickup_s:.0f} s",
            hint="the process that owns the run is not reading commands: it has ended, or its "
                 "run is between runs; check it with ps, or stop it with kill -INT <pid>"))

    def abort(self) -> None:
        self._send("abort")

    def restart(self) -> None:
        self._send("restart")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Detach: stop following. The run is not touched."""
        self.calls.append("shutdown")
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.bus.close(timeout)
