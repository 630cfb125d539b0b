"""The chain's steps that are the project's own commands (data prepare, run, eval), run as a user
runs them: ``python -m dflash_tui.cli VERB ...`` in the repository, output to a log file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dflash_tui(args: list[str], log_file: Path) -> int:
    """Exit code of ``dflash-tui ARGS``; its output appended to ``log_file``. The repository goes
    first on PYTHONPATH, before what the caller's environment had there (packages installed
    beside the interpreter, e.g. carried wheels)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a", encoding="utf-8") as fh:
        return subprocess.run([sys.executable, "-m", "dflash_tui.cli", *args], cwd=ROOT, env=env,
                              stdout=fh, stderr=subprocess.STDOUT).returncode


def last_line(log_file: Path) -> str:
    try:
        lines = log_file.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""
