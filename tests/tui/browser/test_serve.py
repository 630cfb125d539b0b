"""`dflash-tui serve` in a real browser: a headless run, the server in front of it, Chromium
(Debian's, driven by Playwright) on the page.

The page draws the terminal on a canvas, so what it shows is read from the websocket: every byte
the attached dashboard writes to the browser, escape sequences dropped."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from dflash_core.observe import events as ev
from dflash_core.observe.event_log import read_events
from tests.core.engine_fixtures import assets, make_config, write_config  # noqa: F401 - fixture
from tests.core.pipeline.test_headless import ROOT, Headless

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    sync_playwright = None

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (.ci/run installs it)"),
    pytest.mark.skipif(sync_playwright is None,
                       reason="playwright not installed (pip install -e '.[test]')"),
]

RUN_NAME = "served-run"
ESCAPES = re.compile(r"\x1b\[[0-9;?<>=]*[ -/]*[@-~]"  # CSI: cursor moves, colours
                     r"|\x1b\][^\x07\x1b]*(\x07|\x1b\\)"  # OSC
                     r"|\x1b[()=>78MDE]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`dflash-tui serve RUN_DIR --port P [extra]` in a subprocess; ``url`` is what it prints."""

    def __init__(self, run_dir: Path, *extra: str):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_tui.cli", "serve", str(run_dir), "--port",
             str(self.port), *extra], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.out: list[str] = []
        self.url: str | None = None
        got = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.out.append(line)
                m = re.match(r"open (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    got.set()
            got.set()

        threading.Thread(target=read, daemon=True).start()
        if not got.wait(30) or self.url is None:
            self.close()
            raise AssertionError("serve printed no URL:\n" + "".join(self.out))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def attached(self) -> list[psutil.Process]:
        """The `dflash-tui --attach` processes the server started, one per browser session."""
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []


class Screen:
    """What the page's terminal received over its websocket, as text."""

    def __init__(self, page):
        self.page = page
        self.chunks: list[str] = []
        page.on("websocket", lambda ws: ws.on("framereceived", self._frame))

    def _frame(self, payload) -> None:
        if isinstance(payload, bytes):
            payload = payload.decode("utf-8", "replace")
        self.chunks.append(ESCAPES.sub("", payload))

    def text(self) -> str:
        return "".join(self.chunks)

    def wait_for(self, pattern: str, timeout: float = 30.0, after: int = 0) -> re.Match:
        """The first match of ``pattern`` in what arrived after chunk ``after``."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, "".join(self.chunks[after:]))
            if m:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not on the page after {timeout} s; "
                                     f"last text:\n{self.text()[-3000:]}")
            self.page.wait_for_timeout(200)  # lets Playwright deliver the frames

    def press(self, key: str) -> int:
        """Type ``key`` into the terminal; returns the chunk count before it (for wait_for)."""
        n = len(self.chunks)
        self.page.locator(".xterm-helper-textarea").press(key)
        return n


@pytest.fixture(scope="module")
def run(tmp_path_factory, assets):
    """A live headless run, long enough to outlast the module."""
    tmp = tmp_path_factory.mktemp("serve")
    target, data = assets
    cfg = make_config(tmp, target, data, run__name=RUN_NAME, run__max_steps=0,
                      optim__epochs=500, data__eval_prompts=0, checkpoint__every=0)
    headless = Headless(write_config(tmp / "config.yaml", cfg))
    try:
        headless.wait_line("state warmup -> training", 60)
        headless.run_dir = cfg.run_dir
        yield headless
    finally:
        if headless.proc.poll() is None:
            headless.proc.kill()
            headless.proc.wait(10)


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1600, "height": 900})
    # The page asks Google for its font; the test has no network, and waiting on it delays load.
    ctx.route(re.compile(r"^https?://(?!127\.0\.0\.1[:/])"), lambda route: route.abort())
    try:
        yield ctx.new_page()
    finally:
        ctx.close()


def last_step(run_dir: Path) -> int:
    steps = [e.step for e in read_events(run_dir / "events.jsonl")
             if isinstance(e, ev.StepMetrics)]
    return steps[-1] if steps else 0


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.slow  # fast path: tests/tui/test_read_only.py (the same refusals in process)
def test_read_only_view_shows_the_run_and_refuses_abort(run, page):
    served = Served(run.run_dir)
    try:
        assert "token" not in served.url and served.url.startswith("http://127.0.0.1:")
        assert any("ssh -L" in line for line in served.out)
        screen = Screen(page)
        page.goto(served.url)
        screen.wait_for(RUN_NAME, 30)
        screen.wait_for("TRAINING", 30)
        sessions = served.attached()
        assert any("--read-only" in p.cmdline() for p in sessions), [p.cmdline() for p in sessions]
        shown = int(screen.wait_for(r"step\s+([1-9]\d*)", 30).group(1))  # 0 until it reads
        assert shown <= last_step(run.run_dir)  # the run's own step, read from its events

        before = screen.press("a")
        screen.wait_for("read-only view", 10, after=before)
        steps = last_step(run.run_dir)
        page.wait_for_timeout(1500)
        assert "Yes (y)" not in screen.text()  # no confirmation: nothing to confirm
        assert run.proc.poll() is None  # the run was not touched ...
        assert last_step(run.run_dir) > steps  # ... and keeps training
        events = (run.run_dir / "events.jsonl").read_text()
        assert "requested by an attached dashboard" not in events
    finally:
        served.close()
    # Stopping the server ends its sessions: their dashboards detach, the run goes on.
    assert psutil.wait_procs(sessions, timeout=10)[1] == []
    assert run.proc.poll() is None


def browse(url: str, profile: Path, *extra: str) -> subprocess.Popen:
    """Chromium on the page, in a session of its own: killing the session kills all of it."""
    return subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={profile}", "--window-size=1600,900", *extra, url],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def dashboards(run_dir: Path) -> list[psutil.Process]:
    """Every `attach RUN_DIR` process on the machine, whoever its parent is now (an orphan of
    serve is reparented and no longer its child)."""
    wanted = str(run_dir.resolve())
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if "attach" in cmd and wanted in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def started(run_dir: Path, served: Served, timeout: float = 60) -> list[psutil.Process]:
    """The browser's dashboard, once it has been running for a while."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = dashboards(run_dir)
        if found:
            time.sleep(3)  # let it draw and follow the run
            return found
        time.sleep(0.2)
    raise AssertionError(f"no attached dashboard within {timeout} s: " + "".join(served.out))


def left_after(run_dir: Path, timeout: float) -> list[str]:
    """The dashboards still there after ``timeout`` s, with their CPU use and parent."""
    deadline = time.monotonic() + timeout
    while dashboards(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = []
    for p in dashboards(run_dir):
        try:
            left.append(f"pid {p.pid}: {p.cpu_percent(0.5):.0f}% CPU, parent {p.ppid()}")
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.mark.parametrize("how", ["killed", pytest.param("screenshot", marks=pytest.mark.slow)])
def test_a_browser_gone_mid_session_leaves_no_dashboard(run, tmp_path, how):
    served = Served(run.run_dir)
    try:
        if how == "killed":  # SIGKILL: no goodbye on the websocket, the tab is simply gone
            browser = browse(served.url, tmp_path / "profile")
            try:
                started(run.run_dir, served)
            finally:
                os.killpg(browser.pid, signal.SIGKILL)
                browser.wait(10)
        else:  # a headless screenshot: the browser loads the page, shoots it and quits
            browser = browse(served.url, tmp_path / "profile", f"--screenshot={tmp_path}/p.png",
                             "--virtual-time-budget=8000")
            browser.wait(120)
        assert left_after(run.run_dir, 5) == []
        assert served.proc.poll() is None  # the server goes on for the next browser
    finally:
        served.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM,
                                 pytest.param(signal.SIGHUP, marks=pytest.mark.slow),
                                 pytest.param(signal.SIGINT, marks=pytest.mark.slow),
                                 pytest.param(signal.SIGKILL, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGHUP", "SIGINT", "SIGKILL"])  # SIGTERM: the fast path
def test_serve_ended_by_a_signal_leaves_no_dashboard(run, tmp_path, sig):
    served = Served(run.run_dir)
    browser = browse(served.url, tmp_path / "profile")
    try:
        started(run.run_dir, served)
        served.proc.send_signal(sig)
        served.proc.wait(10)
        assert left_after(run.run_dir, 5) == []
    finally:
        os.killpg(browser.pid, signal.SIGKILL)
        browser.wait(10)
        served.close()
    assert run.proc.poll() is None  # the run goes on


def test_control_view_needs_its_token_and_aborts_the_run(run, page):
    served = Served(run.run_dir, "--control")
    try:
        token = re.search(r"\?token=([\w-]+)$", served.url).group(1)
        base = f"http://127.0.0.1:{served.port}"
        assert status(f"{base}/") == 403
        assert status(f"{base}/?token=wrong") == 403
        assert status(f"{base}/ws") == 403
        assert status(f"{base}/ws/wrong") == 403
        assert status(served.url) == 200

        screen = Screen(page)
        page.goto(served.url)
        screen.wait_for("TRAINING", 30)
        assert token in page.locator("#terminal").get_attribute("data-session-websocket-url")
        screen.press("a")
        screen.wait_for(r"Yes \(y\)", 10)
        screen.press("y")
        rc, out, err = run.finish(60)
    finally:
        served.close()
    assert rc == 130, out + err
    assert [e.status for e in read_events(run.run_dir / "events.jsonl")
            if isinstance(e, ev.RunEnded)] == ["aborted"]
