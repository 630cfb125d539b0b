"""A dashboard that owns its run, in a real pseudo-terminal: the terminal hangs up (a dropped SSH
connection) and the run goes on headless in the same process; an attached dashboard's abort then
ends it with a checkpoint. SIGTERM to a dashboard-owned run aborts it with a checkpoint, exit 130.
"""

import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from dflash_tui.sources.follow import FollowController
from tests.core.engine_fixtures import assets, make_config, write_config  # noqa: F401 - fixture

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs a Linux pseudo-terminal")


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def wait_until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what} not seen within {timeout} s")


def steps(run_dir: Path, after: float = 0.0) -> list[dict]:
    return [e for e in events(run_dir) if e["event"] == "StepMetrics" and e["ts"] > after]


class Owner:
    """`dflash-tui --config ...` (the dashboard owns the engine) on a fresh pseudo-terminal."""

    def __init__(self, tmp_path: Path, assets):
        target, data = assets
        cfg = make_config(tmp_path, target, data, run__max_steps=0, optim__epochs=500,
                          data__eval_prompts=0, checkpoint__every=0)
        self.run_dir = cfg.run_dir
        config = write_config(tmp_path / "config.yaml", cfg)
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        env = dict(os.environ, TERM="xterm-256color")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_tui.cli", "--config", str(config)],
            stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
            cwd=tmp_path)
        os.close(slave)

    def read_some(self) -> None:
        """Keep the terminal's buffer from filling while the dashboard draws."""
        try:
            while self.master >= 0:
                r, _, _ = select.select([self.master], [], [], 0)
                if not r:
                    return
                os.read(self.master, 65536)
        except OSError:
            return

    def training(self, timeout: float = 120) -> None:
        def trained():
            self.read_some()
            return len(steps(self.run_dir)) >= 2
        wait_until(trained, timeout, "two training steps")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.master >= 0:
            os.close(self.master)


@pytest.fixture
def owner(tmp_path, assets):
    o = Owner(tmp_path, assets)
    yield o
    o.close()


@pytest.mark.slow  # fast path: test_a_stop_after_the_terminal_died_takes_seconds[no-sighup]
def test_hang_up_goes_on_headless_and_an_attached_abort_ends_it(owner):
    owner.training()
    hung_at = time.time()
    owner.proc.send_signal(signal.SIGHUP)
    os.close(owner.master)  # the terminal is gone: nothing reads it any more
    owner.master = -1

    wait_until(lambda: [e for e in events(owner.run_dir) if e["event"] == "Log"
                        and "terminal hung up" in e["message"]], 30, "the hang-up log line")
    (line,) = [e for e in events(owner.run_dir) if e["event"] == "Log"
               and "terminal hung up" in e["message"]]
    assert f"pid {owner.proc.pid}" in line["message"]
    assert f"dflash-tui attach {owner.run_dir} --control" in line["message"]
    # the run goes on: steps keep arriving after the hang-up, and the process is alive
    wait_until(lambda: len(steps(owner.run_dir, after=hung_at + 1)) >= 3, 60,
               "steps after the hang-up")
    assert owner.proc.poll() is None

    follower = FollowController(owner.run_dir)  # what `dflash-tui attach --control` sends keys through
    follower.abort()
    assert owner.proc.wait(60) == 130
    follower.shutdown(5)
    evs = events(owner.run_dir)
    (end,) = [e for e in evs if e["event"] == "RunEnded"]
    assert end["status"] == "aborted"
    saved = [e for e in evs if e["event"] == "Checkpoint"]
    assert [c["reason"] for c in saved] == ["abort"] and Path(saved[0]["path"]).is_dir()
    assert (owner.run_dir / "console.log").exists()  # where the console went


def test_sigterm_to_a_dashboard_owned_run_aborts_with_a_checkpoint(owner):
    owner.training()
    owner.proc.send_signal(signal.SIGTERM)

    def ended():
        owner.read_some()
        return owner.proc.poll() is not None
    wait_until(ended, 60, "the process's end")
    assert owner.proc.returncode == 130
    evs = events(owner.run_dir)
    (end,) = [e for e in evs if e["event"] == "RunEnded"]
    assert end["status"] == "aborted"
    assert [e["reason"] for e in evs if e["event"] == "Checkpoint"] == ["abort"]


@pytest.mark.parametrize("then_sighup", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["no-sighup", "sighup-after"])
def test_a_stop_after_the_terminal_died_takes_seconds(owner, then_sighup):
    """The program holding the terminal's master is killed. Without a controlling terminal no
    SIGHUP comes; with one it may come after the dashboard's next write has already failed. Once,
    that failed write froze the dashboard's loop, and SIGTERM was ignored for good."""
    owner.training()
    died_at = time.time()
    os.close(owner.master)  # the master's holder is gone: the next write to the terminal fails
    owner.master = -1
    if then_sighup:
        time.sleep(1)
        owner.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: [e for e in events(owner.run_dir) if e["event"] == "Log"
                        and "terminal hung up" in e["message"]], 30, "the hang-up log line")
    wait_until(lambda: len(steps(owner.run_dir, after=died_at + 1)) >= 2, 60,
               "steps after the terminal died")  # the run went on headless
    t0 = time.monotonic()
    owner.proc.send_signal(signal.SIGTERM)
    try:
        rc = owner.proc.wait(30)
    except subprocess.TimeoutExpired:
        raise AssertionError("SIGTERM ignored for 30 s after the terminal died") from None
    took = time.monotonic() - t0
    assert rc == 130
    evs = events(owner.run_dir)
    assert [e["status"] for e in evs if e["event"] == "RunEnded"] == ["aborted"]
    assert [e["reason"] for e in evs if e["event"] == "Checkpoint"] == ["abort"]
    # <= 5 s plus the abort checkpoint's write (a tiny model's: well under a second)
    assert took < 8, f"the stop took {took:.1f} s"
