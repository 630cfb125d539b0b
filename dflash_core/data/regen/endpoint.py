"""One OpenAI-compatible server as ``data regenerate`` sees it: requests with a deadline, the
server's own error text, the fix for what it refuses, and waiting while it is down.

A failed request is a ``RequestFailed`` with a kind (``connection``, ``timeout``,
``http_<status>``, ``bad_response``), the server's text (``{"detail": ...}`` of FastAPI servers,
``{"error": {"message": ...}}`` of vLLM and SGLang) and whether a retry may help. A server that
refuses a request as it is made (a 4xx other than 429) is told apart from one that is down: the
refusal has a fix (``refusal_fix``), the down server is waited for (``Endpoint.wait_up``) with
backoff, without spending a sample's retries, until it answers again or ``limit_s`` passes.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Callable
from urllib.parse import urlsplit

from dflash_core.data.shards import DataError


class RequestFailed(Exception):
    def __init__(self, kind: str, detail: str, retry: bool, status: int = 0,
                 retry_after_s: float | None = None):
        self.kind, self.detail, self.retry, self.status = kind, detail, retry, status
        self.retry_after_s = retry_after_s  # the server's Retry-After (429, 503), in seconds
        super().__init__(f"{kind}: {detail}")

    @property
    def rate_limited(self) -> bool:
        return self.status == 429

    @property
    def refused(self) -> bool:
        """A 4xx answer other than 429: the request as made is refused, a retry changes
        nothing."""
        return 400 <= self.status < 500 and self.status != 429


def retry_after(value: str | None) -> float | None:
    """Seconds a Retry-After header asks for (its delay-seconds form; an HTTP date or nonsense:
    None, the client's own backoff then)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 3600 else None


def error_text(raw: bytes, limit: int = 300) -> str:
    """The server's own words from an error answer's body, on one line."""
    text = raw.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        for v in (obj.get("detail"), err.get("message") if isinstance(err, dict) else err,
                  obj.get("message")):
            if v:
                text = v if isinstance(v, str) else json.dumps(v)
                break
    return " ".join(text.split())[:limit]


def refusal_fix(exc: RequestFailed, api: str, path: str, token_ids: bool) -> str:
    """What to change when a server refuses the requests as they are made (``exc.refused``)."""
    said = exc.detail.lower()
    if token_ids and "return_token_ids" in said:
        return ("this server does not take the field return_token_ids: pass --no-token-ids "
                "(prepare then re-tokenizes the answers' text)")
    if api == "completions" and "prompt" in said and ("string" in said or "str" in said):
        return ("--api completions sends the prompt as token ids and this server takes text "
                "prompts only: use --api chat (the server applies its chat template)")
    if exc.status in (401, 403):
        return ("the server wants an API key: put it in the environment variable that "
                "--api-key-env names (default OPENAI_API_KEY)")
    if exc.status == 404 and "model" in said:
        return "pass --model with the name the server serves (see its /v1/models)"
    if exc.status in (404, 405):
        other = "chat" if api == "completions" else "completions"
        return f"this server has no POST {path}: use --api {other}"
    if any(w in said for w in ("max_tokens", "context", "too long", "maximum", "length")):
        return ("lower --max-tokens, or leave out the conversations longer than the server's "
                "context (its max model length)")
    return ("the server's words above say what it refuses in the request (POST "
            f"{path}: model, {'prompt' if api == 'completions' else 'messages'}, max_tokens, "
            "temperature" + (", return_token_ids" if token_ids else "") + "); change the "
            "server's options or the flags that set it")


class Endpoint:
    """One server; a keep-alive connection per thread; whether it is down, shared by all."""

    def __init__(self, url: str, timeout_s: float, api_key: str | None = None):
        try:
            parts = urlsplit(url if "://" in url else f"http://{url}")
            port = parts.port  # raises for a port that is not a number in 0..65535
        except ValueError as exc:
            raise DataError(f"endpoint {url!r} is not a URL ({exc})",
                            hint="pass --endpoint http://HOST:PORT (repeat it for several)"
                            ) from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise DataError(f"endpoint {url!r} is not an http(s) URL",
                            hint="pass --endpoint http://HOST:PORT (repeat it for several)")
        self.url = url
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = port or (443 if parts.scheme == "https" else 80)
        self.base = parts.path.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.timeout_s = timeout_s
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._local = threading.local()
        self.owned_by: dict[str, str] = {}  # model: owned_by, from /v1/models (``models``)
        # down: since when (monotonic), the next try, and whether the wait ran out
        self.down_since: float | None = None
        self.next_try = 0.0
        self.gave_up = False
        self._up = threading.Event()
        self._up.set()
        self._down_lock = threading.Lock()

    @property
    def name(self) -> str:
        return f"{self.host}_{self.port}"

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            cls = (http.client.HTTPSConnection if self.scheme == "https"
                   else http.client.HTTPConnection)
            c = cls(self.host, self.port, timeout=self.timeout_s)
            self._local.conn = c
        return c

    def _drop(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
        self._local.conn = None

    def request(self, method: str, path: str, body: dict | None = None,
                timeout_s: float | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        limit = timeout_s or self.timeout_s
        deadline = time.monotonic() + limit
        for fresh in (False, True):
            try:
                c = self._conn()
                kept = c.sock is not None
                c.timeout = limit  # the connect's, when this request opens the socket
                if kept:  # a kept-alive socket: its last read left a shorter timeout
                    c.sock.settimeout(limit)
                c.request(method, self.base + path, body=data, headers=self.headers)
                status, raw, after = self._read_by(c, deadline)
                break
            except (socket.timeout, TimeoutError) as exc:
                self._drop()  # the server may still answer on this socket: never reuse it
                raise RequestFailed("timeout", f"no whole answer within {limit:g} s",
                                    True) from exc
            except (OSError, http.client.HTTPException) as exc:
                self._drop()
                if kept and not fresh:
                    # A kept-alive socket the server closed (it restarted, or timed the socket
                    # out): once more on a new one, as HTTP clients do; no retry is spent.
                    continue
                raise RequestFailed("connection", f"{type(exc).__name__}: {exc}", True) from exc
        if status >= 400:
            retry = status == 429 or status >= 500
            raise RequestFailed(f"http_{status}", error_text(raw), retry, status,
                                retry_after(after))
        try:
            out = json.loads(raw)
        except ValueError as exc:
            raise RequestFailed("bad_response", "the answer is not JSON", True) from exc
        if not isinstance(out, dict):
            raise RequestFailed("bad_response", "the answer is not a JSON object", True)
        return out

    def _read_by(self, c: http.client.HTTPConnection,
                 deadline: float) -> tuple[int, bytes, str | None]:
        """The answer's status and body, all of it before ``deadline``: a server that trickles
        its bytes never waits long on one read, so each read gets only the time that is left."""
        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if c.sock is not None:
                c.sock.settimeout(remaining)
            return remaining

        left()
        resp = c.getresponse()
        chunks = []
        while left() and (chunk := resp.read1(1 << 16)):
            chunks.append(chunk)
        if resp.length:  # read1 ends quietly on a socket closed before Content-Length bytes
            raise http.client.IncompleteRead(b"".join(chunks), resp.length)
        resp.close()  # read1 leaves a fully read answer open; a kept-alive socket needs it shut
        return resp.status, b"".join(chunks), resp.getheader("Retry-After")

    def models(self) -> list[str]:
        try:
            out = self.request("GET", "/v1/models")
        except RequestFailed as exc:
            raise DataError(f"endpoint {self.url} does not answer /v1/models ({exc})",
                            hint="start the server, or fix --endpoint") from exc
        data = out.get("data")
        if not isinstance(data, list):
            raise DataError(f"endpoint {self.url} answers /v1/models without a list of models "
                            f"(data: {str(data)[:80]})",
                            hint="point --endpoint at an OpenAI-compatible server (vLLM, "
                                 "SGLang)")
        listed = [m for m in data if isinstance(m, dict)]
        # who the server says owns each model: vLLM "vllm", SGLang "sglang" (provenance)
        self.owned_by = {str(m.get("id")): str(m["owned_by"]) for m in listed
                         if isinstance(m.get("owned_by"), str) and m["owned_by"]}
        return [str(m.get("id")) for m in listed]

    # -- down ------------------------------------------------------------------------------------
    def answers(self) -> bool:
        """Whether the server answers at all now: a connection error on a request is a server
        gone (killed, restarting) when a plain GET cannot connect either."""
        try:
            self.request("GET", "/v1/models", timeout_s=min(10.0, self.timeout_s))
        except RequestFailed as exc:
            return exc.kind != "connection"
        return True

    def down_for(self) -> float:
        since = self.down_since
        return 0.0 if since is None else time.monotonic() - since

    def wait_up(self, stop: threading.Event, limit_s: float, backoff_s: float,
                on_fail: Callable[[RequestFailed], None],
                note: Callable[[str], None]) -> bool:
        """Wait until the server answers again (True), or ``limit_s`` seconds since it went
        down have passed, or ``stop`` is set (False). One caller tries (GET /v1/models, backoff
        doubling to 30 s), the others wait for it; each failed try goes to ``on_fail``."""
        with self._down_lock:
            lead = self.down_since is None and not self.gave_up
            if lead:
                self.down_since = time.monotonic()
                self._up.clear()
        if not lead:
            while not stop.is_set() and not self.gave_up:
                if self._up.wait(0.2):
                    return True
            return False
        note(f"endpoint {self.url} does not answer (connection refused or closed): waiting "
             f"for it, up to {_clock(limit_s)}, trying again with backoff; no retries are "
             "spent meanwhile")
        delay = max(0.05, backoff_s)
        while not stop.is_set():
            if self.down_for() >= limit_s:
                self.gave_up = True
                note(f"endpoint {self.url} still down after {_clock(self.down_for())}: its "
                     "samples are left for the next run")
                return False
            self.next_try = time.monotonic() + delay
            if stop.wait(min(delay, max(0.0, limit_s - self.down_for()))):
                break
            try:
                self.request("GET", "/v1/models", timeout_s=min(10.0, self.timeout_s))
            except RequestFailed as exc:
                on_fail(exc)
                delay = min(30.0, delay * 2)
                continue
            note(f"endpoint {self.url} answers again after {_clock(self.down_for())}")
            with self._down_lock:
                self.down_since = None
                self._up.set()
            return True
        return False

    def status(self) -> str:
        """What the progress line says of this endpoint while it is down ("" when up)."""
        if self.down_since is None or self.gave_up:
            return ""
        return (f"waiting for {self.host}:{self.port} (down {_clock(self.down_for())}, next "
                f"try in {max(0, self.next_try - time.monotonic()):.0f} s)")


def _clock(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 60}:{s % 60:02d}"
