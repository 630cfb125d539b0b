"""``data regenerate``: every assistant turn rewritten by the target, through OpenAI-compatible
servers (vLLM, SGLang, or anything that speaks ``/v1/chat/completions`` or ``/v1/completions``).

Turn by turn: each assistant turn is asked for with the history so far, whose earlier assistant
turns are the target's own answers. Two ways to ask:

- ``api="chat"``: ``/v1/chat/completions`` with the messages; the server applies its template.
- ``api="completions"``: the prompt rendered here with the target's tokenizer and chat template and
  sent as token ids to ``/v1/completions`` (the server sees exactly the ids the drafter will).

Both send ``"return_token_ids": true``: vLLM then returns the answer's ids as
``choices[0].token_ids`` (and the prompt's as ``prompt_token_ids``); other servers ignore the field
(``token_ids=False`` leaves it out for a server that rejects unknown fields). The ids are kept on
the turn (``token_ids``) and ``prepare`` trains on them. Reasoning comes back as
``message.reasoning_content`` (vLLM and SGLang with a reasoning parser) or inline ``<think>``.

Work is spread over the endpoints, ``concurrency`` requests in flight on each. A failed request
(connection error, timeout, HTTP 429 / 5xx, an unreadable answer) is retried with exponential
backoff; a sample whose retries run out is counted by error and left for the next run. Results are
appended, one JSON line per finished sample, to a file per endpoint under ``parts/`` (flushed and
fsynced), so a re-run of the same command skips the ids already there. When every sample is done,
the parts are merged in source order into ``conversations.jsonl`` and ``dflash_regen.json`` is
written last. A server that answers with another model's name stops the run: that data would not
be the target's.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from dflash_core.data.conversations import (
    Conversation, Malformed, read_rows, source_files, source_fingerprint, split_thinking,
)
from dflash_core.data.manifest import write_json_atomic
from dflash_core.data.progress import ProgressLine
from dflash_core.data.shards import DataError

MERGED = "conversations.jsonl"
MANIFEST = "dflash_regen.json"
STATE = "regen_state.json"
PARTS = "parts"


@dataclass
class RegenOptions:
    source: str | Path
    out: str | Path
    endpoints: list[str]
    model: str | None = None  # None: the model the first endpoint serves
    api: str = "chat"  # chat | completions
    tokenizer: str | None = None  # completions: renders the prompt ids
    chat_template: str | Path | None = None
    thinking: str = "keep"
    concurrency: int = 8  # requests in flight per endpoint
    max_tokens: int = 2048
    temperature: float = 0.0
    timeout_s: float = 600.0  # per request: from sending it to the answer's last byte
    retries: int = 4
    backoff_s: float = 1.0
    token_ids: bool = True
    api_key: str | None = None
    limit: int = 0  # 0 = all rows
    progress: bool = True


class ModelMismatch(DataError):
    """An endpoint serves, or answers as, another model than the one asked for."""


class RequestFailed(Exception):
    def __init__(self, kind: str, detail: str, retry: bool):
        self.kind, self.retry = kind, retry
        super().__init__(f"{kind}: {detail}")


# ------------------------------------------------------------------------------------------------
# HTTP
# ------------------------------------------------------------------------------------------------

class Endpoint:
    """One server; a keep-alive connection per thread."""

    def __init__(self, url: str, timeout_s: float, api_key: str | None = None):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise DataError(f"endpoint {url!r} is not an http(s) URL",
                            hint="pass --endpoint http://HOST:PORT (repeat it for several)")
        self.url = url
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.base = parts.path.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.timeout_s = timeout_s
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._local = threading.local()

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

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        deadline = time.monotonic() + self.timeout_s
        try:
            c = self._conn()
            if c.sock is not None:  # a kept-alive socket: its last read left a shorter timeout
                c.sock.settimeout(self.timeout_s)
            c.request(method, self.base + path, body=data, headers=self.headers)
            status, raw = self._read_by(c, deadline)
        except (socket.timeout, TimeoutError) as exc:
            self._drop()  # the server may still answer on this socket: never reuse it
            raise RequestFailed("timeout", f"no whole answer within {self.timeout_s:g} s",
                                True) from exc
        except (OSError, http.client.HTTPException) as exc:
            self._drop()
            raise RequestFailed("connection", f"{type(exc).__name__}: {exc}", True) from exc
        if status >= 400:
            retry = status == 429 or status >= 500
            raise RequestFailed(f"http_{status}", raw[:300].decode("utf-8", "replace"), retry)
        try:
            out = json.loads(raw)
        except ValueError as exc:
            raise RequestFailed("bad_response", "the answer is not JSON", True) from exc
        if not isinstance(out, dict):
            raise RequestFailed("bad_response", "the answer is not a JSON object", True)
        return out

    def _read_by(self, c: http.client.HTTPConnection, deadline: float) -> tuple[int, bytes]:
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
        resp.close()  # read1 leaves a fully read answer open; a kept-alive socket needs it shut
        return resp.status, b"".join(chunks)

    def models(self) -> list[str]:
        try:
            out = self.request("GET", "/v1/models")
        except RequestFailed as exc:
            raise DataError(f"endpoint {self.url} does not answer /v1/models ({exc})",
                            hint="start the server, or fix --endpoint") from exc
        return [str(m.get("id")) for m in out.get("data", []) if isinstance(m, dict)]


# ------------------------------------------------------------------------------------------------
# Asking for one turn
# ------------------------------------------------------------------------------------------------

@dataclass
class Turn:
    content: str
    reasoning: str | None
    token_ids: list[int] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class Asker:
    """Builds the request for the next assistant turn and reads the answer."""

    def __init__(self, opts: RegenOptions, model: str, renderer=None):
        self.opts, self.model, self.renderer = opts, model, renderer

    def body(self, history: list[dict]) -> tuple[str, dict]:
        o = self.opts
        body: dict = {"model": self.model, "max_tokens": o.max_tokens,
                      "temperature": o.temperature}
        if o.token_ids:
            body["return_token_ids"] = True
        if o.api == "completions":
            body["prompt"] = self.renderer.prompt_ids(history)
            return "/v1/completions", body
        body["messages"] = [{"role": m["role"], "content": m["content"]} for m in history]
        return "/v1/chat/completions", body

    def read(self, out: dict) -> Turn:
        if out.get("model") not in (None, self.model):
            raise ModelMismatch(f"the server answered as model {out.get('model')!r}, not "
                                f"{self.model!r}",
                                hint="point --endpoint at servers of the target only")
        try:
            choice = out["choices"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise RequestFailed("bad_response", "no choices in the answer", True) from exc
        if self.opts.api == "completions":
            text, reasoning = choice.get("text"), None
        else:
            msg = choice.get("message") or {}
            text = msg.get("content")
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if not isinstance(text, str):
            raise RequestFailed("bad_response", "the answer holds no text", True)
        if reasoning is None:
            text, reasoning = split_thinking(text)
        ids = choice.get("token_ids")
        ids = [int(x) for x in ids] if isinstance(ids, list) and ids else None
        usage = out.get("usage") or {}
        return Turn(text, reasoning, ids, choice.get("finish_reason"),
                    int(usage.get("prompt_tokens") or 0),
                    int(usage.get("completion_tokens") or (len(ids) if ids else 0)))


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------

@dataclass
class _Counts:
    done: int = 0
    resumed: int = 0
    failed: dict = field(default_factory=dict)  # by the last error's kind
    errors: dict = field(default_factory=dict)  # every failed request, by kind
    retries: int = 0
    turns: int = 0
    with_ids: int = 0
    empty: int = 0  # answers with no text (prepare counts their rows as empty_assistant)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _done_ids(parts: Path) -> dict[str, Path]:
    """ids already regenerated, from the parts; a torn last line (a crash mid-write) is cut."""
    done: dict[str, Path] = {}
    for f in sorted(parts.glob("*.jsonl")):
        with open(f, "rb+") as fh:
            data = fh.read()
            end = data.rfind(b"\n") + 1
            if end != len(data):
                fh.truncate(end)
        for line in data[:end].splitlines():
            try:
                done[str(json.loads(line)["id"])] = f
            except (ValueError, KeyError, TypeError):
                continue
    return done


def _check_state(out: Path, state: dict) -> None:
    """A re-run continues only the same job: same source, model and generation options."""
    path = out / STATE
    if path.exists():
        was = json.loads(path.read_text(encoding="utf-8"))
        diff = [k for k in state if was.get(k) != state[k]]
        if diff:
            raise DataError(
                "this folder holds a regeneration with other settings: " + ", ".join(
                    f"{k} {was.get(k)!r} (now {state[k]!r})" for k in diff), file=out,
                hint="re-run with the same settings to continue it, or pass another --out")
    else:
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, state)


def regenerate(opts: RegenOptions) -> dict:
    """Run (or continue) a regeneration. Returns the summary; ``summary["finished"]`` is False
    when some samples failed (a re-run retries them). Raises DataError for bad input."""
    t0 = time.monotonic()
    if opts.api not in ("chat", "completions"):
        raise DataError(f"api must be chat or completions, got {opts.api!r}")
    if not opts.endpoints:
        raise DataError("no endpoint given", hint="pass --endpoint http://HOST:PORT")
    if opts.concurrency < 1 or opts.retries < 0 or opts.max_tokens < 1:
        raise DataError("--concurrency and --max-tokens must be >= 1, --retries >= 0")
    _, files = source_files(opts.source)
    renderer = None
    if opts.api == "completions":
        if not opts.tokenizer:
            raise DataError("--api completions renders the prompt here: it needs --tokenizer",
                            hint="pass --tokenizer TARGET_FOLDER (or use --api chat)")
        from dflash_core.data.chat_render import ChatRenderer, load_tokenizer
        renderer = ChatRenderer(load_tokenizer(opts.tokenizer, opts.chat_template),
                                opts.thinking)
    endpoints = [Endpoint(u, opts.timeout_s, opts.api_key) for u in opts.endpoints]
    if len({e.name for e in endpoints}) != len(endpoints):
        raise DataError("the same endpoint is given twice", hint="list each server once")
    model = opts.model
    for e in endpoints:
        served = e.models()
        if model is None:
            if not served:
                raise DataError(f"endpoint {e.url} lists no model", hint="pass --model NAME")
            model = served[0]
        if model not in served:
            raise ModelMismatch(f"endpoint {e.url} serves {served}, not {model!r}",
                                hint="point every --endpoint at a server of the target "
                                     "(or pass --model with the name it is served under)")

    out = Path(opts.out).expanduser()
    if out.is_dir() and any(out.iterdir()) and not (out / STATE).exists():
        raise DataError("the output folder already holds other files", file=out,
                        hint="pass --out a new or empty folder (a folder of an earlier "
                             "regenerate is continued)")
    _check_state(out, {"source_fingerprint": source_fingerprint(files), "model": model,
                       "api": opts.api, "thinking": opts.thinking,
                       "max_tokens": opts.max_tokens, "temperature": opts.temperature,
                       "limit": opts.limit})
    parts = out / PARTS
    parts.mkdir(exist_ok=True)
    done = _done_ids(parts)
    counts = _Counts(resumed=len(done))

    rows, malformed = [], {}
    for k, r in enumerate(read_rows(opts.source)):
        if opts.limit and k >= opts.limit:
            break
        if isinstance(r, Malformed):
            malformed[r.reason] = malformed.get(r.reason, 0) + 1
        else:
            rows.append(r)
    todo = [r for r in rows if r.id not in done]
    bar = ProgressLine("regenerate", len(rows), "samples", enabled=opts.progress)
    bar.done = bar.start_done = len(rows) - len(todo)
    asker = Asker(opts, model, renderer)
    fatal: list[BaseException] = []
    stop = threading.Event()
    work: queue.Queue = queue.Queue()
    for r in todo:
        work.put(r)
    writers = {e.name: open(parts / f"{i}-{e.name}.jsonl", "a", encoding="utf-8")
               for i, e in enumerate(endpoints)}
    write_lock = threading.Lock()

    def one(e: Endpoint, conv: Conversation) -> dict:
        history, turns = [], []
        for m in conv.messages:
            if m["role"] != "assistant":
                history.append(m)
                continue
            path, body = asker.body(history)
            turn = _with_retries(e, path, body, asker, opts, counts, stop)
            msg = {"role": "assistant", "content": turn.content}
            if turn.reasoning:
                msg["reasoning_content"] = turn.reasoning
            if turn.token_ids:
                msg["token_ids"] = turn.token_ids
            history.append(msg)
            turns.append({"finish_reason": turn.finish_reason, "prompt_tokens":
                          turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
                          "server_ids": turn.token_ids is not None,
                          "empty": not (turn.content.strip() or turn.reasoning)})
        return {"id": conv.id, "messages": history, **conv.extra,
                "regenerated": {"model": model, "endpoint": e.url, "turns": turns}}

    def worker(e: Endpoint) -> None:
        while not stop.is_set():
            try:
                conv = work.get_nowait()
            except queue.Empty:
                return
            try:
                row = one(e, conv)
            except RequestFailed as exc:
                with counts.lock:
                    counts.failed[exc.kind] = counts.failed.get(exc.kind, 0) + 1
                bar.update(add=0, failed=sum(counts.failed.values()))
                continue
            except BaseException as exc:  # a model mismatch, or a bug: stop everything
                fatal.append(exc)
                stop.set()
                return
            line = json.dumps(row, ensure_ascii=False) + "\n"
            with write_lock:
                fh = writers[e.name]
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())  # a finished sample survives a crash of this process
            with counts.lock:
                counts.done += 1
                for t in row["regenerated"]["turns"]:
                    counts.turns += 1
                    counts.with_ids += t["server_ids"]
                    counts.empty += t["empty"]
                    counts.prompt_tokens += t["prompt_tokens"]
                    counts.completion_tokens += t["completion_tokens"]
            bar.update(add=1, errors=sum(counts.errors.values()), retries=counts.retries)

    threads = [threading.Thread(target=worker, args=(e,), daemon=True, name=f"regen-{e.name}")
               for e in endpoints for _ in range(opts.concurrency)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except KeyboardInterrupt:
        stop.set()
        raise
    finally:
        for fh in writers.values():
            fh.close()
        bar.close()
    if fatal:
        raise fatal[0]

    failed = sum(counts.failed.values())
    summary = {
        "model": model, "api": opts.api, "endpoints": [e.url for e in endpoints],
        "options": {"max_tokens": opts.max_tokens, "temperature": opts.temperature,
                    "thinking": opts.thinking, "concurrency": opts.concurrency,
                    "timeout_s": opts.timeout_s, "retries": opts.retries},
        "counts": {"samples": len(rows), "done_now": counts.done, "resumed": counts.resumed,
                   "failed": dict(sorted(counts.failed.items())),
                   "request_errors": dict(sorted(counts.errors.items())),
                   "retries": counts.retries, "malformed": dict(sorted(malformed.items())),
                   "turns": counts.turns, "turns_with_server_ids": counts.with_ids,
                   "empty_answers": counts.empty},
        "tokens": {"prompt": counts.prompt_tokens, "completion": counts.completion_tokens},
        "seconds": round(time.monotonic() - t0, 2),
        "samples_per_s": round(counts.done / max(1e-9, time.monotonic() - t0), 2),
        "finished": failed == 0,
    }
    if failed == 0:
        _merge(out, rows)
        write_json_atomic(out / MANIFEST, summary)
    return summary


def _with_retries(e: Endpoint, path: str, body: dict, asker: Asker, opts: RegenOptions,
                  counts: _Counts, stop: threading.Event) -> Turn:
    for attempt in range(opts.retries + 1):
        try:
            return asker.read(e.request("POST", path, body))
        except RequestFailed as exc:
            with counts.lock:
                counts.errors[exc.kind] = counts.errors.get(exc.kind, 0) + 1
            if not exc.retry or attempt == opts.retries or stop.is_set():
                raise
            with counts.lock:
                counts.retries += 1
            # Exponential backoff with jitter: servers that restarted are not hit in lockstep.
            delay = min(30.0, opts.backoff_s * 2 ** attempt) * (0.5 + random.random() / 2)
            stop.wait(delay)
    raise AssertionError("unreachable")


def _merge(out: Path, rows: list[Conversation]) -> None:
    """The parts, in source order, into conversations.jsonl (atomically)."""
    by_id: dict[str, str] = {}
    for f in sorted((out / PARTS).glob("*.jsonl")):
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    by_id[str(json.loads(line)["id"])] = line if line.endswith("\n") else line + "\n"
    tmp = out / f".{MERGED}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(by_id[r.id])
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / MERGED)
