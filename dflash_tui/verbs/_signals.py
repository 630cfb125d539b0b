"""SIGTERM and a terminal hang-up end a verb as Ctrl-C does.

Python's default for both is to die on the spot: an eval's child processes (vLLM's engine, in a
session of its own) would be left running and its summary unwritten. Within ``as_interrupt``
they raise KeyboardInterrupt instead, which each verb already turns into its "interrupted" line
(every whole batch kept, children ended). A signal the user chose to ignore (``nohup``: SIGHUP)
stays ignored; off the main thread nothing changes (only it may set handlers).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def as_interrupt(signals=SIGNALS):
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in signals}
    for s, h in old.items():
        if h is signal.SIG_DFL:
            signal.signal(s, _interrupt)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
