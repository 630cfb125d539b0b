"""The lifeline of a dashboard that `dflash-tui serve` started for one browser: the process ends
when its session or its server goes away, however abruptly, and within a second of SIGTERM.

Such a dashboard talks to the server only through pipes (Textual's web driver: keys and window
sizes in on stdin, the screen out on stdout), and Textual alone does not end it when they go:

- at end of file on stdin its input thread stops without a word and the app goes on following the
  run, drawing into a pipe nobody reads, after the server has gone;
- the screen is written to stdout from the event loop's thread with blocking writes, so once the
  server stops reading (its session ended, it was stopped with SIGSTOP, its reader task died) the
  loop hangs in a write, and the SIGTERM handler, which runs on that loop, never runs: SIGTERM is
  ignored until the pipe drains, which may be never.

The lifeline is one thread that needs neither the loop nor the main thread. SIGTERM, SIGINT and
SIGHUP are blocked in every thread (the mask is set before any thread starts, and threads inherit
it) and taken by this one with ``sigtimedwait``; between signals it checks that stdin and stdout
are still connected and that the server is still its parent (and asks the kernel for SIGTERM
when the parent dies). On any of these it asks the app to exit and, if the process is still there
``GRACE_S`` later, ends it with ``os._exit``: a view holds nothing that could be lost (it only
reads the run's events; a command it sends is one atomic file).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
POLL_S = 0.2
GRACE_S = 0.5  # then the process ends however busy its loop is: POLL_S + GRACE_S < 1 s
PARENT_ENV = "DFLASH_SERVE_PID"  # set by serve: the pid its dashboards must outlive never
PR_SET_PDEATHSIG = 1  # linux/prctl.h
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL


def served() -> bool:
    """This process runs under Textual's web driver, i.e. textual-serve started it."""
    return os.environ.get("TEXTUAL_DRIVER", "").endswith(":WebDriver")


class Lifeline:
    """``arm()`` before any thread starts, ``watch(app)`` once the app exists."""

    def __init__(self) -> None:
        self.app: Any = None
        self.reason: str | None = None
        self.exit_code = 0
        parent = os.environ.get(PARENT_ENV, "")
        self.parent = int(parent) if parent.isdigit() else os.getppid()
        self._thread: threading.Thread | None = None

    def arm(self) -> "Lifeline":
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        _die_with_parent()
        self._thread = threading.Thread(target=self._watch, name="lifeline", daemon=True)
        self._thread.start()
        return self

    def watch(self, app: Any) -> None:
        self.app = app

    # ------------------------------------------------------------------ the thread
    def _watch(self) -> None:
        poller = select.poll()
        for fd in (0, 1):
            poller.register(fd, 0)  # no events asked: only hang-up and error are reported
        while self.reason is None:
            sig = signal.sigtimedwait(SIGNALS, POLL_S)
            if sig is not None:
                self._end(f"{signal.Signals(sig.si_signo).name}", 128 + sig.si_signo)
            elif any(ev & _GONE for _, ev in poller.poll(0)):
                self._end("the server closed the session's pipes", 0)
            elif os.getppid() != self.parent:
                self._end("the server is gone", 0)
        self._ask_exit()
        # The normal exit has GRACE_S; past it the process is stuck (a write to a full pipe,
        # a loop that no longer turns): end it here.
        threading.Event().wait(GRACE_S)
        os._exit(self.exit_code)

    def _end(self, reason: str, code: int) -> None:
        self.reason, self.exit_code = reason, code

    def _ask_exit(self) -> None:
        app = self.app
        if app is None:
            return
        try:
            from textual.messages import ExitApp

            app.post_message(ExitApp())  # thread-safe; a no-op once the app is closing
        except Exception:  # the app may be half torn down: the hard exit follows anyway
            pass


def _die_with_parent() -> None:
    """Ask Linux to send SIGTERM when the parent dies (taken by the lifeline thread). If the
    parent died before this call, getppid() no longer names it, which the thread also sees."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # without it the thread's getppid() check still ends the process within POLL_S
