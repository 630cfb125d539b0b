"""End to end in a real terminal: `dflash-tui --demo` inside tmux, as an operator runs it."""

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux not installed (.ci/run installs it)")

SESSION = "dflash-e2e"


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def screen() -> str:
    return tmux("capture-pane", "-p", "-t", SESSION)


def wait_for(pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = screen()
        m = re.search(pattern, text)
        if m:
            return m
        time.sleep(0.5)
    raise AssertionError(f"{pattern!r} not on screen after {timeout} s; screen:\n{text}")


@pytest.fixture
def shell(tmp_path: Path, demo_data, dflash_cache):
    """A tmux session running a shell, 120x40, whose environment finds the cached demo assets."""
    subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    env_cmd = f"export DFLASH_CACHE={dflash_cache} TERM=xterm-256color; cd {tmp_path}"
    tmux("new-session", "-d", "-s", SESSION, "-x", "120", "-y", "40", "bash", "--norc")
    tmux("send-keys", "-t", SESSION, env_cmd, "Enter")
    yield tmp_path
    subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)


def test_demo_trains_aborts_and_quits_cleanly(shell: Path):
    cli = f"{sys.executable} -m dflash_tui.cli --demo --output-dir runs --max-steps 2000"
    tmux("send-keys", "-t", SESSION, f"{cli}; echo EXIT=$?", "Enter")
    wait_for(r"TRAINING", timeout=240)
    first = wait_for(r"loss (\d+\.\d+)", timeout=60).group(1)
    deadline = time.monotonic() + 60
    second = first
    while second == first and time.monotonic() < deadline:
        time.sleep(2)
        second = wait_for(r"loss (\d+\.\d+)", timeout=10).group(1)
    assert second != first, "the loss on screen did not change while training"

    tmux("send-keys", "-t", SESSION, "a")
    wait_for(r"Yes \(y\)", timeout=10)
    tmux("send-keys", "-t", SESSION, "y")
    wait_for(r"ABORTED", timeout=30)
    assert list((shell / "runs" / "demo" / "checkpoints").glob("step-*")), "no abort checkpoint"

    tmux("send-keys", "-t", SESSION, "q")
    wait_for(r"EXIT=130", timeout=30)  # the exit code says how the run ended: aborted
    # The shell is usable again: it runs a command and the screen is not left in the app.
    tmux("send-keys", "-t", SESSION, "echo SHELL_OK_$((6*7))", "Enter")
    wait_for(r"SHELL_OK_42", timeout=10)
    assert "TRAINING" not in screen() and "ABORTED" not in screen()


@pytest.mark.slow  # fast paths: test_follow.py's attach (in process), and the demo test above in tmux
def test_attach_to_a_headless_run_aborts_it_and_detaches(shell: Path):
    # One terminal's headless run, another terminal's dashboard: here both in one shell, the
    # headless run in the background.
    cli = f"{sys.executable} -m dflash_tui.cli --demo --output-dir runs --max-steps 2000"
    tmux("send-keys", "-t", SESSION, f"({cli} --headless > headless.log 2>&1; echo $? > "
         "headless.rc) &", "Enter")
    deadline = time.monotonic() + 120
    while "state warmup -> training" not in _read(shell / "headless.log"):
        assert time.monotonic() < deadline, _read(shell / "headless.log")
        time.sleep(0.5)
    attach = f"{sys.executable} -m dflash_tui.cli --attach runs/demo"
    tmux("send-keys", "-t", SESSION, f"{attach}; echo EXIT=$?", "Enter")
    wait_for(r"TRAINING", timeout=60)
    wait_for(r"attached to", timeout=30)

    tmux("send-keys", "-t", SESSION, "a")
    wait_for(r"Yes \(y\)", timeout=10)
    tmux("send-keys", "-t", SESSION, "y")
    wait_for(r"ABORTED", timeout=30)  # the headless run ended, and the dashboard saw it
    tmux("send-keys", "-t", SESSION, "q")
    wait_for(r"EXIT=0", timeout=30)
    deadline = time.monotonic() + 30
    while not _read(shell / "headless.rc") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _read(shell / "headless.rc").strip() == "130"  # aborted, with its checkpoint
    log = _read(shell / "headless.log")
    assert "abort requested by an attached dashboard" in log
    assert re.search(r"checkpoint step \d+ \(abort\)", log), log


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""
