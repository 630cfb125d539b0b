"""Whether a process of this host still runs, by its pid: the one check behind the data lock's
takeover (data/lock.py) and the cleaning of hidden checkpoint folders (checkpoint/folders.py)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: checks the process exists, sends nothing
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, as another user's process
    return True
