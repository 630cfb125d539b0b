"""`dflash-tui serve RUN_DIR`: the attached dashboard in a browser, through textual-serve (its
arguments: `dflash_tui/verbs/serve.py`).

Each browser connection runs its own `dflash-tui attach RUN_DIR` process (textual-serve starts
one per websocket), so the training process is never duplicated: the page is one more attached
dashboard. Bound to 127.0.0.1 by default; reach it from a laptop with `ssh -L`.

Read-only by default, as every view (the rule of `attach` too): the dashboards run with
--read-only, so a and r are refused on screen and nothing is sent to the run. --control runs
them with --control and lets a and r through, and then every request must carry a
random token: the page as `/?token=T`, its websocket as `/ws/T` (the page's script appends
`?width=..&height=..` to the websocket address, so the token travels in the path there). A request
without the right token gets 403. Only textual-serve's own scripts and styles (/static) are
served without it; they say nothing about the run.

Serve owns its dashboards: each runs in a process group of its own (``exec``'d by the shell, so
the group leader is the dashboard itself) and knows serve's pid (``DFLASH_SERVE_PID``), so it ends
when serve does, even by SIGKILL (`lifeline.py` beside this). When a session ends (the browser closed,
crashed or was killed) its dashboard is asked to quit, then sent SIGTERM after ``QUIT_GRACE_S``,
then SIGKILL, and always reaped; SIGINT, SIGTERM and SIGHUP end serve the same way for all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import signal
import socket
import sys
from pathlib import Path
from typing import Any

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
LOOPBACK = ("127.0.0.1", "localhost", "::1")
QUIT_GRACE_S = 2.0  # a dashboard asked to quit has this long before SIGTERM ...
KILL_GRACE_S = 1.0  # ... and then this long before SIGKILL
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def attach_command(run_dir: Path, read_only: bool) -> str:
    """The shell command textual-serve runs for each browser connection."""
    cmd = [sys.executable, "-m", "dflash_tui.cli", "attach", str(run_dir.resolve()),
           "--read-only" if read_only else "--control"]
    # exec: the shell becomes the dashboard, so signals and the parent's death reach it directly.
    return "exec " + " ".join(shlex.quote(part) for part in cmd)


async def end_process(process, quit_grace: float = 0.0) -> None:
    """Wait ``quit_grace`` for ``process`` to end by itself, then SIGTERM its group, then SIGKILL
    it; reap it in every case (no zombie, no orphan)."""
    for sig, grace in ((None, quit_grace), (signal.SIGTERM, KILL_GRACE_S),
                       (signal.SIGKILL, None)):
        if process.returncode is not None:
            return
        if sig is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)  # its own group (start_new_session)
        try:
            await asyncio.wait_for(process.wait(), grace)
            return
        except asyncio.TimeoutError:
            continue


def page_url(host: str, port: int, token: str | None) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def make_server(run_dir: Path, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                token: str | None = None):
    """A textual-serve Server for the run; ``token`` set = control mode (a, r reach the run)."""
    import aiohttp_jinja2
    from aiohttp import web
    from textual_serve.app_service import AppService
    from textual_serve.server import Server, to_int

    from dflash_tui.browser.lifeline import PARENT_ENV

    class Session(AppService):
        """One browser's dashboard process, which serve ends and reaps whatever happens."""

        def _build_environment(self, width: int = 80, height: int = 24) -> dict[str, str]:
            env = super()._build_environment(width, height)
            env[PARENT_ENV] = str(os.getpid())
            return env

        async def _open_app_process(self, width: int = 80, height: int = 24):
            self._process = await asyncio.create_subprocess_shell(
                self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self._build_environment(width, height),
                start_new_session=True)  # its own group: one killpg reaches all of it
            self._stdin = self._process.stdin
            return self._process

        async def stop(self) -> None:
            process = self._process
            loop = asyncio.get_running_loop()
            deadline = loop.time() + QUIT_GRACE_S
            if self._task is not None:
                # Asks the dashboard to quit and reads its screen until it does. The reading
                # may have ended already (a write to a closed websocket ends it): then the
                # dashboard may be stuck writing to a pipe nobody reads; end_process ends it.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(super().stop(), QUIT_GRACE_S)
                self._task = None
            if process is not None:
                await end_process(process, max(0.0, deadline - loop.time()))

    class DashboardServer(Server):
        def __init__(self) -> None:
            super().__init__(attach_command(run_dir, read_only=token is None), host=host,
                             port=port, title=f"dflash {run_dir.name}")
            self.token = token
            self.run_dir = run_dir
            self._sessions: set[asyncio.Task] = set()
            self._services: set[Session] = set()

        async def handle_websocket(self, request: web.Request) -> web.StreamResponse:
            task = asyncio.current_task()
            self._sessions.add(task)
            websocket = web.WebSocketResponse(heartbeat=15)  # a vanished browser: ~15 s
            service: Session | None = None
            try:
                await websocket.prepare(request)
                service = Session(self.command, write_bytes=websocket.send_bytes,
                                  write_str=websocket.send_str, close=websocket.close,
                                  download_manager=self.download_manager, debug=self.debug)
                self._services.add(service)
                await service.start(to_int(request.query.get("width", "80"), 80),
                                    to_int(request.query.get("height", "24"), 24))
                await self._process_messages(websocket, service)
            except asyncio.CancelledError:  # serve is stopping
                await websocket.close()
            except Exception as exc:  # one broken session must not stop the server
                print(f"dashboard session ended: {exc!r}", file=sys.stderr, flush=True)
            finally:
                if service is not None:
                    await asyncio.shield(service.stop())
                    self._services.discard(service)
                self._sessions.discard(task)
            return websocket

        async def end_all(self) -> None:
            """Last resort when serve ends: no dashboard outlives it."""
            for service in list(self._services):
                if service._process is not None:
                    await end_process(service._process)

        async def on_shutdown(self, app: web.Application) -> None:
            # Ctrl+C: end each browser's session now (its dashboard detaches, the page says the
            # session ended) rather than wait for the browsers to leave.
            for task in list(self._sessions):
                task.cancel()
            if self._sessions:
                await asyncio.wait(list(self._sessions), timeout=5)

        async def _make_app(self) -> web.Application:
            app = await super()._make_app()
            if self.token is not None:
                # The page's websocket address is ws://HOST/ws/TOKEN (see the module's doc).
                app.router.add_get("/ws/{token}", self.handle_websocket, name="websocket-token")
            app.middlewares.append(self._guard)
            return app

        @web.middleware
        async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
            if self.token is not None and not request.path.startswith("/static/"):
                given = request.match_info.get("token") or request.query.get("token", "")
                if not secrets.compare_digest(given.encode(), self.token.encode()):
                    raise web.HTTPForbidden(text="403: this dashboard takes the token printed by "
                                                 "`dflash-tui serve --control` (?token=...)\n")
            return await handler(request)

        @aiohttp_jinja2.template("app_index.html")
        async def handle_index(self, request: web.Request) -> dict[str, Any]:
            # Addresses from the request's own Host header, not from --host / --port: behind
            # `ssh -L 9000:127.0.0.1:8000` the browser knows the server as localhost:9000.
            base = f"{request.scheme}://{request.host}"
            ws = f"{'wss' if request.scheme == 'https' else 'ws'}://{request.host}/ws"
            if self.token is not None:
                ws += f"/{self.token}"
            return {
                "font_size": to_int(request.query.get("fontsize", "16"), 16),
                "app_websocket_url": ws,
                "config": {"static": {"url": f"{base}/static/"}},
                "application": {"name": self.title},
            }

        async def on_startup(self, app: web.Application) -> None:
            pass  # the address is printed once the socket listens (see _serve)

        def serve(self, debug: bool = False) -> None:
            self.debug = debug
            self.initialize_logging()
            asyncio.run(self._serve())

        async def _serve(self) -> None:
            runner = web.AppRunner(await self._make_app(), handle_signals=False,
                                   shutdown_timeout=5)
            await runner.setup()
            try:
                await web.TCPSite(runner, host, port).start()  # OSError: port taken
                # Printed only now, so whoever reads the URL can open it at once.
                print(describe(self.run_dir, host, port, self.token), flush=True)
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in STOP_SIGNALS:
                    loop.add_signal_handler(sig, stop.set)
                await stop.wait()
            finally:
                try:
                    await runner.cleanup()  # on_shutdown ends the sessions
                finally:
                    await self.end_all()

    return DashboardServer()


def describe(run_dir: Path, host: str, port: int, token: str | None) -> str:
    mode = ("control: a (abort) and r (restart) reach the run; keep the URL to yourself"
            if token else "read-only: a and r are refused (serve with --control to allow them)")
    lines = [f"serving the dashboard of {run_dir} ({mode})",
             f"open {page_url(host, port, token)}"]
    if host in LOOPBACK:
        lines.append(f"from another machine: ssh -L {port}:127.0.0.1:{port} "
                     f"{socket.gethostname()}  then open the URL above there")
    else:
        lines.append(f"warning: listening on {host}: anyone who reaches port {port} sees the run")
    lines.append("each browser tab runs its own attached dashboard; Ctrl+C stops serving (the "
                 "run goes on)")
    return "\n".join(lines)
