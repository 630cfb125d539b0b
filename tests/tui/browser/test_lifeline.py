"""A dashboard as `dflash-tui serve` runs it (Textual's web driver on pipes), with the server's
side played by the test: it ends when the pipes go, when its server is gone, and within a second
of SIGTERM even while its screen is stuck in a write to a pipe nobody reads."""

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from dflash_core.observe import events as ev
from dflash_tui.browser.lifeline import PARENT_ENV
from tests.core.pipeline.test_headless import ROOT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux signals and pipes")


@pytest.fixture
def live_run(tmp_path):
    """A run folder whose events.jsonl grows, as a training run's does."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stop = threading.Event()

    def write() -> None:
        with open(run_dir / "events.jsonl", "a", encoding="utf-8") as f:
            n = 0
            while not stop.wait(0.05):
                n += 1
                f.write(ev.Log(level="info", source="test", message=f"line {n}").to_json() + "\n")
                f.flush()

    t = threading.Thread(target=write, daemon=True)
    t.start()
    yield run_dir
    stop.set()
    t.join(5)


class View:
    """`dflash-tui attach RUN` (a view) under the web driver, its pipes held by the test."""

    def __init__(self, run_dir: Path, **env: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_tui.cli", "attach", str(run_dir), "--read-only"],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, "TEXTUAL_DRIVER": "textual.drivers.web_driver:WebDriver",
                 "COLUMNS": "160", "ROWS": "48", PARENT_ENV: str(os.getpid()), **env})
        self.received = 0

    def started(self, timeout: float = 60) -> "View":
        """Waits for the driver's greeting, then reads the screen for a while."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready and self.proc.stdout.readline() == b"__GANGLION__\n"
        self.read_for(2.0)
        assert self.proc.poll() is None and self.received > 0
        return self

    def read_for(self, seconds: float) -> None:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if select.select([fd], [], [], 0.1)[0]:
                data = os.read(fd, 1 << 16)
                if not data:
                    return
                self.received += len(data)

    def gone_within(self, timeout: float) -> float | None:
        """Seconds until the process ended, or None when it is still there after ``timeout``."""
        t0 = time.monotonic()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return time.monotonic() - t0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


@pytest.fixture
def view(live_run):
    v = View(live_run)
    yield v
    v.close()


@pytest.mark.slow  # fast path: test_a_view_whose_server_closed_its_pipes_ends
def test_sigterm_ends_a_view_stuck_writing_to_a_full_pipe_within_a_second(view):
    view.started()
    # The server stops reading (its reader ended with the websocket): the pipe fills and the
    # view's event loop hangs in a write, where a loop-run SIGTERM handler never runs.
    time.sleep(3)
    cpu = psutil.Process(view.proc.pid).cpu_percent(0.5)
    view.proc.send_signal(signal.SIGTERM)
    took = view.gone_within(5)
    assert took is not None, "SIGTERM ignored by a view whose screen pipe is full"
    assert took < 1.5, f"SIGTERM took {took:.2f} s"  # 0.7 s by design; slack for a busy host
    assert cpu < 50, f"the stuck view used {cpu:.0f}% CPU"


def test_a_view_whose_server_closed_its_pipes_ends(view):
    view.started()
    view.proc.stdin.close()
    view.proc.stdout.close()  # the server's process ended: both ends of its pipes closed
    took = view.gone_within(3)
    assert took is not None, "the view outlived its server's pipes"


def test_a_view_ends_when_its_server_is_not_its_parent_any_more(live_run):
    # What a view sees after serve died by SIGKILL: it was reparented, its parent pid changed.
    v = View(live_run, **{PARENT_ENV: "1"})
    try:
        took = v.gone_within(60)  # imports first: on a busy machine that takes a while
        assert took is not None, "the view outlived its server"
        assert v.proc.returncode == 0
    finally:
        v.close()


def test_a_connected_view_keeps_running(view):
    view.started()
    view.read_for(3.0)  # the lifeline does not end a healthy view
    assert view.proc.poll() is None
