"""One writer per output folder: a lock file beside the folder, naming the writer.

``.<name>.lock`` sits next to the output folder, not in it (prepare replaces the folder itself).
The lock is an ``flock`` on that file, and the file holds the writer's pid, host, verb and start:
the kernel drops an flock when its process dies, so a writer that was killed leaves a file but
no lock, and the next writer takes it over and says so. A lock file written on another host is
not taken over: an flock taken there may not be seen here (network file systems), and whether
its process lives cannot be checked from here.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from dflash_core.data.shards import DataError
from dflash_core.pids import pid_alive


class OutputBusy(DataError):
    """Another process is writing the same output folder."""


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def _holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {"unreadable": True}


def _who(h: dict) -> str:
    if h.get("unreadable") or not h:
        return "a process that did not say who it is"
    since = time.strftime("%H:%M:%S", time.localtime(h.get("started", 0)))
    return f"data {h.get('verb', '?')}, pid {h.get('pid', '?')} on {h.get('host', '?')}, " \
           f"since {since}"


class OutputLock:
    """``with OutputLock(out, "prepare"):`` holds the lock of ``out`` or raises OutputBusy."""

    def __init__(self, out: str | Path, verb: str, note=None):
        self.out = Path(out)
        self.path = lock_path(self.out)
        self.verb = verb
        self.note = note if note is not None else (
            lambda text: print(f"note: {text}", file=sys.stderr))
        self._fd: int | None = None

    def acquire(self) -> None:
        host = socket.gethostname()
        while True:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise DataError(f"cannot create the lock file {self.path.name} beside the "
                                f"output folder ({exc.strerror})", file=self.out,
                                hint="pass --out a folder in a place you can write") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = _holder(fd)
                os.close(fd)
                raise OutputBusy(f"another process is writing this folder ({_who(held)})",
                                 file=self.out, hint="wait for it to finish, or pass another "
                                                     "--out") from None
            # Its last holder unlinks the file on release: one opened before that is not the
            # lock any more. Retry on the file that is there now.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        held = _holder(fd)
        if held and not held.get("unreadable"):
            if held.get("host") != host:
                os.close(fd)
                raise OutputBusy(f"the lock file names a writer on another host ({_who(held)}), "
                                 "which cannot be checked from here", file=self.out,
                                 hint=f"if that process has ended, remove {self.path} and run "
                                      "again; else wait for it, or pass another --out")
            pid = held.get("pid")
            state = "no longer running" if isinstance(pid, int) and not pid_alive(pid) \
                else "which no longer holds it"
            self.note(f"took over the lock of {self.out}, left by {_who(held)} ({state})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"verb": self.verb, "pid": os.getpid(), "host": host,
                                  "started": time.time()}).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still held: no one else's file is removed
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OutputLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
