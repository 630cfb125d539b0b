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
fsynced), so a re-run of the same command skips the ids already there; a line damaged anywhere in
a part is set aside (``DAMAGED``) and its sample asked again. When every sample is done,
the parts are merged in source order into ``conversations.jsonl`` and ``dflash_regen.json`` is
written last. A server that answers with another model's name stops the run: that data would not
be the target's. The output folder is never an input nor a folder of other files, and has one
writer at a time (``output``, ``lock``).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import queue
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from dflash_core.data.conversations import (
    Conversation, Malformed, RowError, read_rows, source_files, source_fingerprint,
    split_thinking,
)
from dflash_core.data.lock import OutputLock
from dflash_core.data.manifest import write_json_atomic
from dflash_core.data.output import OWNER, check_apart, check_out, mark_owner
from dflash_core.data.progress import ProgressLine
from dflash_core.data.shards import DataError

MERGED = "conversations.jsonl"
MANIFEST = "dflash_regen.json"
STATE = "regen_state.json"
PARTS = "parts"
DAMAGED = "parts-damaged.txt"  # lines of the parts that could not be read, kept for a look


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
        data = out.get("data")
        if not isinstance(data, list):
            raise DataError(f"endpoint {self.url} answers /v1/models without a list of models "
                            f"(data: {str(data)[:80]})",
                            hint="point --endpoint at an OpenAI-compatible server (vLLM, "
                                 "SGLang)")
        return [str(m.get("id")) for m in data if isinstance(m, dict)]


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
            try:
                body["prompt"] = self.renderer.prompt_ids(history)
            except RowError:
                raise
            except Exception as exc:  # the tokenizer's own error on this row's text
                raise RowError("render_error", f"{type(exc).__name__}: {exc}") from exc
            return "/v1/completions", body
        body["messages"] = [{"role": m["role"], "content": m["content"]} for m in history]
        return "/v1/chat/completions", body

    def read(self, out: dict) -> Turn:
        if out.get("model") not in (None, self.model):
            raise ModelMismatch(f"the server answered as model {out.get('model')!r}, not "
                                f"{self.model!r}",
                                hint="point --endpoint at servers of the target only")
        # Every field is checked: an answer that cannot be used is a failed request (retried,
        # then counted), never an exception that stops the run.
        try:
            choice = out["choices"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise RequestFailed("bad_response", "no choices in the answer", True) from exc
        if not isinstance(choice, dict):
            raise RequestFailed("bad_response", "choices[0] is not an object", True)
        if self.opts.api == "completions":
            text, reasoning = choice.get("text"), None
        else:
            msg = choice.get("message")
            if not isinstance(msg, dict):
                raise RequestFailed("bad_response", "choices[0].message is not an object", True)
            text = msg.get("content")
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if not isinstance(text, str):
            raise RequestFailed("bad_response", "the answer holds no text", True)
        if reasoning is not None and not isinstance(reasoning, str):
            raise RequestFailed("bad_response", "the answer's reasoning is not text", True)
        if reasoning is None:
            text, reasoning = split_thinking(text)
        for what, value in (("text", text), ("reasoning", reasoning or "")):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestFailed("bad_response", f"the answer's {what} holds a lone "
                                    "surrogate", True) from None
        ids = choice.get("token_ids")
        if ids is not None and not (isinstance(ids, list) and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids)):
            raise RequestFailed("bad_response", "token_ids is not a list of token ids", True)
        ids = list(ids) if ids else None
        usage = out.get("usage")
        usage = usage if isinstance(usage, dict) else {}

        def count(key: str, default: int) -> int:
            v = usage.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default

        finish = choice.get("finish_reason")
        return Turn(text, reasoning, ids, finish if isinstance(finish, str) else None,
                    count("prompt_tokens", 0), count("completion_tokens", len(ids or ())))


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------

@dataclass
class _Counts:
    done: int = 0
    resumed: int = 0
    failed: dict = field(default_factory=dict)  # by the last error's kind
    errors: dict = field(default_factory=dict)  # every failed request, by kind
    left_out: dict = field(default_factory=dict)  # rows that cannot be asked for, by reason
    left_out_ids: set = field(default_factory=set)
    examples: dict = field(default_factory=dict)  # the first sample of each failure / reason
    retries: int = 0
    turns: int = 0
    with_ids: int = 0
    empty: int = 0  # answers with no text (prepare counts their rows as empty_assistant)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tally(self, into: dict, key: str, rid: str, detail: str) -> None:
        with self.lock:
            into[key] = into.get(key, 0) + 1
            self.examples.setdefault(key, f"{rid}: {detail}"[:300])


def _part_line(raw: bytes) -> tuple[str | None, str]:
    """(the sample id, "") of a usable line of a parts file, or (None, why it is damaged)."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
    except ValueError as exc:
        return None, str(exc)
    if not (isinstance(row, dict) and isinstance(row.get("id"), (str, int))
            and isinstance(row.get("messages"), list)):
        return None, "not a sample (no id or no messages)"
    return str(row["id"]), ""


def _read_part(data: bytes) -> tuple[list[tuple[str, bytes]], list[tuple[int, bytes, str]]]:
    """(id, line) of each usable line of a parts file's bytes, and (line number, line, why) of
    each damaged one."""
    good, bad = [], []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        rid, why = _part_line(raw)
        if rid is None:
            bad.append((n, raw, why))
        else:
            good.append((rid, raw))
    return good, bad


def _repair_parts(out: Path) -> tuple[set[str], list[str]]:
    """The ids already done, from the parts, and what was damaged. A damaged line anywhere (a
    torn last line after a crash, a byte changed on disk) is moved to ``DAMAGED`` (kept, not
    deleted) and its sample is asked again; the part is rewritten atomically without it."""
    done: set[str] = set()
    damaged: list[str] = []
    for f in sorted((out / PARTS).glob("*.jsonl")):
        data = f.read_bytes()
        good, bad = _read_part(data)
        done.update(rid for rid, _ in good)
        if not bad and (not data or data.endswith(b"\n")):
            continue
        damaged += [f"{PARTS}/{f.name} line {n}: {why}" for n, _, why in bad]
        if bad:
            with open(out / DAMAGED, "ab") as fh:
                fh.write(b"".join(raw + b"\n" for _, raw, _ in bad))
                fh.flush()
                os.fsync(fh.fileno())
        tmp = f.parent / f".{f.name}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(b"".join(raw + b"\n" for _, raw in good))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, f)
    return done, damaged


def _check_state(out: Path, state: dict) -> None:
    """A re-run continues only the same job: same source, model and generation options."""
    path = out / STATE
    if path.exists():
        try:
            was = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(was, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            raise DataError(f"unreadable {STATE} ({exc}): the settings of the regeneration in "
                            "this folder are not known", file=path,
                            hint="pass another --out for a new regeneration (this one's "
                                 f"finished samples stay in {out / PARTS})") from exc
        diff = [k for k in state if was.get(k) != state[k]]
        if diff:
            raise DataError(
                "this folder holds a regeneration with other settings: " + ", ".join(
                    f"{k} {was.get(k)!r} (now {state[k]!r})" for k in diff), file=out,
                hint="re-run with the same settings to continue it, or pass another --out")
    else:
        write_json_atomic(path, state)


def check_options(opts: RegenOptions) -> None:
    """The numbers the command line checks too, for callers of ``regenerate``."""
    def whole(v, lo):
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo

    def real(v, lo, strict):
        return isinstance(v, (int, float)) and math.isfinite(v) and (v > lo if strict
                                                                     else v >= lo)
    bad = [f"{name} must be {want}, got {v!r}" for name, v, ok, want in (
        ("concurrency", opts.concurrency, whole(opts.concurrency, 1), ">= 1"),
        ("max_tokens", opts.max_tokens, whole(opts.max_tokens, 1), ">= 1"),
        ("retries", opts.retries, whole(opts.retries, 0), ">= 0"),
        ("limit", opts.limit, whole(opts.limit, 0), ">= 0 (0 = all rows)"),
        ("timeout_s", opts.timeout_s, real(opts.timeout_s, 0, True), "a number > 0"),
        ("temperature", opts.temperature, real(opts.temperature, 0, False), "a number >= 0"),
        ("backoff_s", opts.backoff_s, real(opts.backoff_s, 0, False), "a number >= 0"),
    ) if not ok]
    if opts.api not in ("chat", "completions"):
        bad.append(f"api must be chat or completions, got {opts.api!r}")
    if bad:
        raise DataError("; ".join(bad), hint="see dflash-tui data regenerate --help")


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def regenerate(opts: RegenOptions) -> dict:
    """Run (or continue) a regeneration. Returns the summary; ``summary["finished"]`` is False
    when some samples failed (a re-run retries them). Raises DataError for bad input."""
    t0 = time.monotonic()
    check_options(opts)
    if not opts.endpoints:
        raise DataError("no endpoint given", hint="pass --endpoint http://HOST:PORT")
    _, files = source_files(opts.source)
    out = Path(opts.out).expanduser().resolve()  # a link: the folder it names
    check_apart(out, [("conversations source", opts.source), ("tokenizer folder",
                      opts.tokenizer), ("chat template", opts.chat_template)])
    check_out(out, "regenerate", overwrite=False)  # before asking any server
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
    with OutputLock(out, "regenerate", _note):
        check_out(out, "regenerate", overwrite=False)
        out.mkdir(parents=True, exist_ok=True)
        if not (out / OWNER).exists():
            mark_owner(out, "regenerate")
        _check_state(out, {"source_fingerprint": source_fingerprint(files), "model": model,
                           "api": opts.api, "thinking": opts.thinking,
                           "max_tokens": opts.max_tokens, "temperature": opts.temperature,
                           "limit": opts.limit})
        return _run(opts, out, endpoints, model, renderer, t0)


def _run(opts: RegenOptions, out: Path, endpoints: list[Endpoint], model: str, renderer,
         t0: float) -> dict:
    parts = out / PARTS
    parts.mkdir(exist_ok=True)
    done, damaged = _repair_parts(out)
    counts = _Counts(resumed=len(done))

    rows, malformed = [], {}
    for k, r in enumerate(read_rows(opts.source)):
        if opts.limit and k >= opts.limit:
            break
        if isinstance(r, Malformed):
            counts.tally(malformed, r.reason, r.id, r.detail)
        else:
            rows.append(r)
    counts.resumed = sum(r.id in done for r in rows)
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
                counts.tally(counts.failed, exc.kind, conv.id, str(exc))
                bar.update(add=0, failed=sum(counts.failed.values()))
                continue
            except RowError as exc:  # its prompt cannot be rendered: left out, counted
                counts.tally(counts.left_out, exc.reason, conv.id, str(exc))
                counts.left_out_ids.add(conv.id)
                bar.update(add=0, left_out=sum(counts.left_out.values()))
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
                   "left_out": dict(sorted(counts.left_out.items())),
                   "damaged_lines": len(damaged),
                   "turns": counts.turns, "turns_with_server_ids": counts.with_ids,
                   "empty_answers": counts.empty},
        "examples": dict(sorted(counts.examples.items())),
        "damaged": damaged[:5],
        "tokens": {"prompt": counts.prompt_tokens, "completion": counts.completion_tokens},
        "seconds": round(time.monotonic() - t0, 2),
        "samples_per_s": round(counts.done / max(1e-9, time.monotonic() - t0), 2),
        "finished": failed == 0,
    }
    if failed == 0:
        _merge(out, [r for r in rows if r.id not in counts.left_out_ids])
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
    """The parts, in source order, into conversations.jsonl (atomically). Reads only the lines
    ``_repair_parts`` would keep, so a line damaged since never stops the merge."""
    by_id: dict[str, bytes] = {}
    for f in sorted((out / PARTS).glob("*.jsonl")):
        by_id.update(_read_part(f.read_bytes())[0])
    missing = [r.id for r in rows if r.id not in by_id]
    if missing:  # every sample was counted done: a part lost lines while this ran
        raise DataError(f"{len(missing)} finished samples are missing from {out / PARTS} "
                        f"(e.g. {missing[0]}): the parts changed while this ran", file=out,
                        hint="run the same command again: it asks for them again")
    tmp = out / f".{MERGED}.tmp"
    with open(tmp, "wb") as fh:
        for r in rows:
            fh.write(by_id[r.id] + b"\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / MERGED)
