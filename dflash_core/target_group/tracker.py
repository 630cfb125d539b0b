"""multiprocessing's resource tracker, started with a real stderr.

The queues and locks of a target group register their semaphores with the tracker, a process
CPython starts at the first registration and hands ``sys.stderr.fileno()``. Under the dashboard
``sys.stderr`` is Textual's capture, whose fileno is -1, and the start fails with "bad value(s)
in fds_to_keep". So the tracker is started here first, with the process's own stderr (or
/dev/null where there is none), before any group makes a queue.
"""

from __future__ import annotations

import contextlib
import os
import sys
from multiprocessing import resource_tracker


def _usable_fd(stream) -> bool:
    try:
        return stream is not None and stream.fileno() >= 0
    except (AttributeError, OSError, ValueError):
        return False


def ensure_resource_tracker() -> None:
    """Start (or find running) this process's resource tracker; a no-op once it runs."""
    if _usable_fd(sys.stderr):
        resource_tracker.ensure_running()
        return
    with contextlib.ExitStack() as stack:
        stream = sys.__stderr__ if _usable_fd(sys.__stderr__) else stack.enter_context(
            open(os.devnull, "w"))
        saved, sys.stderr = sys.stderr, stream
        try:
            resource_tracker.ensure_running()
        finally:
            sys.stderr = saved
