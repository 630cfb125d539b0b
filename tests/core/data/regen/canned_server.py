"""An OpenAI-compatible server on 127.0.0.1 whose answers a test writes: fast (no model), and able
to answer what no real server should (fields of the wrong type, no choices), to refuse requests
as real servers do (a status and the server's words), and to go down and come back on its port."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

MODEL = "canned"


@dataclass
class Reply:
    """An answer of another status than 200 (``body``: a dict sent as JSON, or bytes)."""
    status: int
    body: object
    headers: dict = field(default_factory=dict)  # e.g. {"Retry-After": "2"}


def echo(body: dict) -> dict:
    """A well-formed chat answer: the last user text, reversed (so answers are checkable)."""
    last = [m["content"] for m in body.get("messages", []) if m["role"] == "user"][-1]
    return {"model": MODEL, "choices": [{"message": {"role": "assistant", "content": last[::-1]},
                                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(last), "completion_tokens": len(last)}}


def strict_fields(answer: Callable[[dict], object] = echo) -> Callable[[dict], object]:
    """A server that refuses fields it does not know, as FastAPI servers do (transformers
    serve's words)."""
    def check(body: dict):
        if "return_token_ids" in body:
            return Reply(422, {"detail": "Unexpected fields in the request: "
                                         "{'return_token_ids'}"})
        return answer(body)
    return check


class CannedServer:
    """``answers``: the bodies of the first requests' answers, in order (a dict is sent as
    JSON, bytes as they are, a ``Reply`` with its status); later requests get ``answer(body)``
    (``echo``). ``models``: the answer to ``GET /v1/models``. ``bodies``: every request's
    body. ``go_down`` / ``come_back``: open connections closed and new ones refused meanwhile,
    then the same port. ``keep_alive``: HTTP/1.1 connections kept open, as real servers."""

    def __init__(self, answers: list | None = None,
                 answer: Callable[[dict], object] = echo, models=None, delay_s: float = 0.0,
                 keep_alive: bool = False):
        self.answers = list(answers or [])
        self.models = models if models is not None else {
            "object": "list", "data": [{"id": MODEL, "object": "model"}]}
        self.answer = answer
        self.delay_s = delay_s
        self.keep_alive = keep_alive
        self._conns: set = set()
        self.requests = 0
        self.bodies: list[dict] = []
        self._lock = threading.Lock()
        self._port = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if server.keep_alive else "HTTP/1.0"

            def setup(self):
                super().setup()
                with server._lock:
                    server._conns.add(self.connection)

            def finish(self):
                with server._lock:
                    server._conns.discard(self.connection)
                super().finish()

            def log_message(self, *a):
                pass

            def _send(self, obj) -> None:
                status, headers = 200, {}
                if isinstance(obj, Reply):
                    status, obj, headers = obj.status, obj.body, obj.headers
                raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                self._send(server.models)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    server.requests += 1
                    server.bodies.append(body)
                    canned = server.answers.pop(0) if server.answers else None
                if server.delay_s:
                    time.sleep(server.delay_s)
                self._send(canned if canned is not None else server.answer(body))

        return Handler

    def _start(self) -> None:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self._port), self._handler())
        self._httpd.daemon_threads = True
        self._port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def _close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        with self._lock:  # a killed server's kept-alive connections die with it
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def go_down(self) -> None:
        self._close()

    def come_back(self) -> None:
        self._start()

    def __enter__(self) -> "CannedServer":
        self._start()
        return self

    def __exit__(self, *exc) -> None:
        self._close()


def convs(tmp_path, n: int, extra=()):
    """A JSONL of ``n`` one-turn conversations (ids c0..), plus ``extra`` rows, to regenerate."""
    rows = [{"id": f"c{k}", "messages": [{"role": "user", "content": f"question {k}"},
                                         {"role": "assistant", "content": "old"}]}
            for k in range(n)] + list(extra)
    path = tmp_path / "convs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def quick_opts(src, out, url, **kw):
    """regenerate's options against a canned server: one worker, no retries or back-off waits,
    no progress line; ``kw`` overrides."""
    from dflash_core.data.regen.options import RegenOptions
    base = dict(concurrency=1, timeout_s=10, backoff_s=0.0, retries=0, progress=False)
    base.update(kw)
    return RegenOptions(src, out, [url], **base)
