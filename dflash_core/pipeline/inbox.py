"""Commands from a dashboard attached to a run in another process (``dflash-tui attach --control``).

The attached dashboard drops one file per command into ``<run_dir>/commands/`` (written under a
temporary name and renamed, so it appears whole); the process that owns the engine polls that
folder and dispatches each command through ``control.dispatch``. Files rather than a socket:
nothing listens, whoever can write the run folder (the operator's account) can command the run,
and it works the same on a shared filesystem.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

from dflash_core.pipeline.control import Controller, dispatch
from dflash_core.observe.events import Error, Event, Log

COMMAND_DIR = "commands"
# What another process may ask. "shutdown" is the owner's alone: an attached dashboard quitting
# detaches, it never ends the run.
REMOTE_COMMANDS = ("abort", "restart", "stacks")
POLL_S = 0.25
_TMP = ".tmp"


def command_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / COMMAND_DIR


def send_command(run_dir: str | Path, command: str) -> Path:
    """Queue ``command`` for the process that owns the run in ``run_dir``; returns the file."""
    if command not in REMOTE_COMMANDS:
        raise ValueError(f"unknown remote command {command!r}; known: {REMOTE_COMMANDS}")
    folder = command_dir(run_dir)
    folder.mkdir(exist_ok=True)
    name = f"{time.time_ns()}-{os.getpid()}-{command}"
    tmp = folder / (name + _TMP)
    tmp.write_text(command + "\n")
    final = folder / name
    os.replace(tmp, final)
    return final


def _command_of(path: Path) -> str:
    return path.name.rsplit("-", 1)[-1]


class CommandInbox:
    """Polls ``<run_dir>/commands/`` on a daemon thread and dispatches what it finds.

    Files already there when the inbox opens are from an earlier process: removed unread, so a
    stale ``abort`` cannot end a new run. A file is removed before its command runs, so a
    command that fails is reported once, not retried forever.
    """

    def __init__(self, controller: Controller, run_dir: str | Path,
                 publish: Callable[[Event], None], poll_s: float = POLL_S):
        self.controller = controller
        self.folder = command_dir(run_dir)
        self.publish = publish
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            stale = self._pending()
        except OSError:
            # The run folder cannot be read or made (under a file, no permission): preflight
            # says so with the key and a hint; the inbox has nothing to clear.
            stale = []
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            self.publish(Log(level="warning", source="inbox", message=(
                f"ignored {len(stale)} command file(s) left from an earlier process in "
                f"{self.folder}")))
        self._thread = threading.Thread(target=self._run, name="inbox", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    def _pending(self) -> list[Path]:
        try:
            return sorted(p for p in self.folder.iterdir()
                          if not p.name.endswith(_TMP) and not p.name.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def poll_once(self) -> list[str]:
        """Dispatch every queued command, oldest first; returns their names."""
        done = []
        for path in self._pending():
            try:
                path.unlink()
            except FileNotFoundError:
                continue  # taken by another poll
            command = _command_of(path)
            if command not in REMOTE_COMMANDS:
                self.publish(Log(level="warning", source="inbox", message=(
                    f"ignored {path.name} in {self.folder}: not one of {REMOTE_COMMANDS}")))
                continue
            self.publish(Log(level="info", source="inbox",
                             message=f"{command} requested by an attached dashboard"))
            try:
                dispatch(self.controller, command)
            except Exception as exc:  # noqa: BLE001 - reported, the inbox keeps serving
                self.publish(Error(error_kind="internal", source="inbox", fatal=False,
                                   message=f"{command} from an attached dashboard failed: {exc}",
                                   hint="see the traceback; the run itself is unaffected"))
            done.append(command)
        return done

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll_once()
            except OSError as exc:  # the run folder went away or is unreadable: say so, go on
                self.publish(Log(level="warning", source="inbox",
                                 message=f"cannot read {self.folder}: {exc}"))
                self._stop.wait(5.0)


def open_inbox(controller: Controller, run_dir: str | Path | None) -> CommandInbox | None:
    """A started inbox for the run folder, or None when the folder is unknown (a config that
    cannot be read: the run will fail at preflight and say why)."""
    if run_dir is None:
        return None
    inbox = CommandInbox(controller, run_dir, controller.bus.publish)
    inbox.start()
    return inbox
