"""An OpenAI-compatible server on 127.0.0.1 whose answers a test writes: fast (no model), and able
to answer what no real server should (fields of the wrong type, no choices)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

MODEL = "canned"


def echo(body: dict) -> dict:
    """A well-formed chat answer: the last user text, reversed (so answers are checkable)."""
    last = [m["content"] for m in body.get("messages", []) if m["role"] == "user"][-1]
    return {"model": MODEL, "choices": [{"message": {"role": "assistant", "content": last[::-1]},
                                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(last), "completion_tokens": len(last)}}


class CannedServer:
    """``answers``: the bodies of the first requests' answers, in order (a dict is sent as
    JSON, bytes as they are); later requests get ``answer`` (``echo``). ``models``: the answer
    to ``GET /v1/models``."""

    def __init__(self, answers: list | None = None,
                 answer: Callable[[dict], dict] = echo, models=None):
        self.answers = list(answers or [])
        self.models = models if models is not None else {
            "object": "list", "data": [{"id": MODEL, "object": "model"}]}
        self.answer = answer
        self.requests = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, obj) -> None:
                raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
                self.send_response(200)
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
                    canned = server.answers.pop(0) if server.answers else None
                self._send(canned if canned is not None else server.answer(body))

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> "CannedServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
