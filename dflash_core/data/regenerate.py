"""``data regenerate``: every assistant turn rewritten by the target, through OpenAI-compatible
servers (vLLM, SGLang, ``transformers serve``, or anything that speaks ``/v1/chat/completions`` or
``/v1/completions``).

Turn by turn: each assistant turn is asked for with the history so far, whose earlier assistant
turns are the target's own answers. Two ways to ask:

- ``api="chat"``: ``/v1/chat/completions`` with the messages; the server applies its template.
- ``api="completions"``: the prompt rendered here with the target's tokenizer and chat template and
  sent as token ids to ``/v1/completions`` (the server sees exactly the ids the drafter will).

Both ask for ``"return_token_ids": true``: vLLM then returns the answer's ids as
``choices[0].token_ids``; other servers ignore the field or refuse it. The ids are kept on the
turn (``token_ids``) and ``prepare`` trains on them. Reasoning comes back as
``message.reasoning_content`` (vLLM and SGLang with a reasoning parser) or inline ``<think>``.

One probe request goes first (``_Job.probe``): it finds out what the server takes (token ids,
else text: a server that refuses ``return_token_ids`` is asked for text), says so in one line,
and stops the command with the server's own words and the fix when it refuses the request as
made (``--api completions`` on a server that takes text prompts only). When only text comes
back, the line says what a text round trip may change, and with the target at hand
(``target``) measures it on the probe's answer (``round_trip``).

Work is spread over the endpoints, ``concurrency`` requests in flight on each. A failed request
(timeout, HTTP 429 / 5xx, an unreadable answer) is retried with exponential backoff; a sample
whose retries run out is counted by error and left for the next run. A run of identical refusals
(4xx) stops the command with the fix instead of sending the rest. An endpoint that stops
answering (connection refused) is waited for, with backoff, up to ``down_wait_s``, without
spending retries: its samples go back to the queue, the progress line says it waits. Results are
appended, one JSON line per finished sample, to a file per endpoint under ``parts/`` (flushed and
fsynced), so a re-run of the same command skips the ids already there; a line damaged anywhere in
a part is set aside (``DAMAGED``) and its sample asked again. When every sample is done, the parts
are merged in source order into ``conversations.jsonl`` and ``dflash_regen.json`` is written
last. A server that answers with another model's name stops the run: that data would not be the
target's. The output folder is never an input nor a folder of other files, and has one writer at a
time (``output``, ``lock``); its settings bind it once a sample was written there.
"""

from __future__ import annotations

import json
import math
import os
import queue
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_core.data import round_trip
from dflash_core.data.conversations import (
    Conversation, Malformed, RowError, read_rows, source_files, source_fingerprint,
    split_thinking,
)
from dflash_core.data.endpoint import Endpoint, RequestFailed, refusal_fix
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
PROBE_TOKENS = 32  # the probe's answer: enough to see the server's ways, short to wait for
PROBE_ROWS = 16  # rows tried for a probe whose prompt renders
REFUSALS_IN_A_ROW = 5  # identical 4xx answers in a row that stop a run


@dataclass
class RegenOptions:
    source: str | Path
    out: str | Path
    endpoints: list[str]
    model: str | None = None  # None: the model the first endpoint serves
    api: str = "chat"  # chat | completions
    tokenizer: str | None = None  # completions: renders the prompt ids; target: the measure
    chat_template: str | Path | None = None
    thinking: str = "keep"
    concurrency: int = 8  # requests in flight per endpoint
    max_tokens: int = 2048
    temperature: float = 0.0
    timeout_s: float = 600.0  # per request: from sending it to the answer's last byte
    retries: int = 4
    backoff_s: float = 1.0
    down_wait_s: float = 1800.0  # how long an endpoint that does not answer is waited for
    token_ids: bool = True
    api_key: str | None = None
    limit: int = 0  # 0 = all rows
    progress: bool = True
    target: Any = None  # a loaded HF causal LM of the target: measures a text round trip


class ModelMismatch(DataError):
    """An endpoint serves, or answers as, another model than the one asked for."""


class ServerRefuses(DataError):
    """The server refuses the requests as they are made (4xx): a flag or its options fix it."""


class ServerFailing(Exception):
    """The server cannot answer (down past the wait, or failing the probe past its retries):
    nothing is wrong with the input; the same command continues once it answers."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


class EndpointDown(Exception):
    """A request found its endpoint not answering at all: wait for it, spend no retry."""


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
        self.token_ids = opts.token_ids  # False once the probe found the field refused

    @property
    def path(self) -> str:
        return "/v1/completions" if self.opts.api == "completions" else "/v1/chat/completions"

    def body(self, history: list[dict]) -> tuple[str, dict]:
        o = self.opts
        body: dict = {"model": self.model, "max_tokens": o.max_tokens,
                      "temperature": o.temperature}
        if self.token_ids:
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


def _has_samples(out: Path) -> bool:
    """Whether a sample was ever written in this folder (a usable line of a part)."""
    return any(_read_part(f.read_bytes())[0] for f in sorted((out / PARTS).glob("*.jsonl")))


def _check_state(out: Path, state: dict, generated: bool) -> str:
    """A re-run continues only the same job: same source, model and generation options, once a
    sample was written; a folder where nothing was generated takes the new settings. Returns a
    note on settings replaced ("" when none)."""
    path = out / STATE
    was: Any = None
    if path.exists():
        try:
            was = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(was, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            if generated:
                raise DataError(f"unreadable {STATE} ({exc}): the settings of the regeneration "
                                "in this folder are not known", file=path,
                                hint="pass another --out for a new regeneration (this one's "
                                     f"finished samples stay in {out / PARTS})") from exc
            was = None
    diff = [k for k in state if isinstance(was, dict) and was.get(k) != state[k]]
    if diff and generated:
        raise DataError(
            "this folder holds a regeneration with other settings: " + ", ".join(
                f"{k} {was.get(k)!r} (now {state[k]!r})" for k in diff), file=out,
            hint="re-run with the same settings to continue it, or pass another --out")
    if was != state:
        write_json_atomic(path, state)
    if diff:
        return ("nothing was generated in this folder yet: it takes the new settings (" +
                ", ".join(f"{k} {was.get(k)!r} -> {state[k]!r}" for k in diff) + ")")
    return ""


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
        ("down_wait_s", opts.down_wait_s, real(opts.down_wait_s, 0, False), "a number >= 0"),
    ) if not ok]
    if opts.api not in ("chat", "completions"):
        bad.append(f"api must be chat or completions, got {opts.api!r}")
    if bad:
        raise DataError("; ".join(bad), hint="see dflash-tui data regenerate --help")


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def _say(text: str) -> None:
    print(text, file=sys.stderr)


def regenerate(opts: RegenOptions) -> dict:
    """Run (or continue) a regeneration. Returns the summary; ``summary["finished"]`` is False
    when some samples failed (a re-run retries them). Raises DataError for bad input (and for a
    server that refuses the requests as made: ``ServerRefuses``, with the fix), ServerFailing
    for a server that cannot answer."""
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
    if opts.api == "completions" or opts.target is not None:
        if not opts.tokenizer:
            raise DataError("--api completions renders the prompt here: it needs --tokenizer"
                            if opts.api == "completions" else "measuring a text round trip "
                            "with --target renders the answers here: it needs --tokenizer",
                            hint="pass --tokenizer TARGET_FOLDER" + (
                                " (or use --api chat)" if opts.api == "completions" else ""))
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
        replaced = _check_state(out, {
            "source_fingerprint": source_fingerprint(files), "model": model, "api": opts.api,
            "thinking": opts.thinking, "max_tokens": opts.max_tokens,
            "temperature": opts.temperature, "limit": opts.limit}, _has_samples(out))
        if replaced:
            _note(replaced)
        return _Job(opts, out, endpoints, model, renderer).run(t0)


class _Progress(ProgressLine):
    """The progress line, with the endpoints being waited for."""

    def __init__(self, *args, endpoints: list[Endpoint], **kw):
        super().__init__(*args, **kw)
        self.endpoints = endpoints

    def line(self) -> str:
        return ", ".join([super().line(), *filter(None, (e.status() for e in self.endpoints))])


def _first_prompt(conv: Conversation) -> list[dict]:
    """The messages before a conversation's first assistant turn."""
    out = []
    for m in conv.messages:
        if m["role"] == "assistant":
            break
        out.append(m)
    return out


class _Job:
    """One run over the samples left: the probe, the workers, the refusals, the waits."""

    def __init__(self, opts: RegenOptions, out: Path, endpoints: list[Endpoint], model: str,
                 renderer):
        self.opts, self.out, self.endpoints, self.model = opts, out, endpoints, model
        self.renderer = renderer
        self.asker = Asker(opts, model, renderer)
        self.counts = _Counts()
        self.stop = threading.Event()
        self.fatal: list[BaseException] = []
        self.work: queue.Queue = queue.Queue()
        self.pending = 0  # samples neither finished nor failed: queued or in flight
        self.lock = threading.Lock()
        self.refusal: tuple | None = None  # the last refusal and how many in a row
        self.refusals = 0
        self.bar: _Progress | None = None

    # -- asking -----------------------------------------------------------------------------------
    def count_error(self, exc: RequestFailed) -> None:
        with self.counts.lock:
            self.counts.errors[exc.kind] = self.counts.errors.get(exc.kind, 0) + 1
        self.show()

    def show(self, add: int = 0) -> None:
        if self.bar is not None:
            c = self.counts
            self.bar.update(add=add, errors=sum(c.errors.values()), retries=c.retries,
                            failed=sum(c.failed.values()), left_out=sum(c.left_out.values()))

    def ask(self, e: Endpoint, path: str, body: dict) -> Turn:
        for attempt in range(self.opts.retries + 1):
            try:
                return self.asker.read(e.request("POST", path, body))
            except RequestFailed as exc:
                self.count_error(exc)
                if exc.kind == "connection" and not self.stop.is_set() and not e.answers():
                    raise EndpointDown(e.url) from exc  # down: waited for, no retry spent
                if not exc.retry or attempt == self.opts.retries or self.stop.is_set():
                    raise
                with self.counts.lock:
                    self.counts.retries += 1
                # Exponential backoff with jitter: servers that restarted are not hit in
                # lockstep.
                delay = min(30.0, self.opts.backoff_s * 2 ** attempt) * (0.5 + random.random()
                                                                         / 2)
                self.stop.wait(delay)
        raise AssertionError("unreachable")

    def wait_up(self, e: Endpoint) -> bool:
        return e.wait_up(self.stop, self.opts.down_wait_s, self.opts.backoff_s,
                         self.count_error, _note)

    def refused(self, e: Endpoint, exc: RequestFailed) -> None:
        """A refusal (4xx); the same one ``REFUSALS_IN_A_ROW`` times in a row stops the run."""
        with self.lock:
            key = (exc.kind, exc.detail)
            self.refusals = self.refusals + 1 if key == self.refusal else 1
            self.refusal = key
            if self.refusals >= REFUSALS_IN_A_ROW and not self.fatal:
                self.fatal.append(self.refusal_error(
                    e, exc, f"refused {self.refusals} requests in a row with the same answer"))
                self.stop.set()

    def refusal_error(self, e: Endpoint, exc: RequestFailed, what: str) -> ServerRefuses:
        path = self.asker.path
        return ServerRefuses(f"{e.url} {what} ({exc.kind}: {exc.detail}); the other samples "
                             f"were not sent (POST {path})",
                             hint=refusal_fix(exc, self.opts.api, path, self.asker.token_ids))

    # -- the probe --------------------------------------------------------------------------------
    def probe(self, todo: list[Conversation]) -> dict:
        """One request before the rest: what the server takes (token ids, else text), its
        refusal with the fix, and with text only what the round trip does to the target's
        tokens (measured with the target at hand). Said in one line."""
        e = self.endpoints[0]
        for conv in todo[:PROBE_ROWS]:
            history = _first_prompt(conv)
            if not history:  # an odd row (it opens with the answer) is not the server's test
                continue
            try:
                path, body = self.asker.body(history)
            except RowError:  # this row's prompt cannot be rendered: the run counts it
                continue
            break
        else:
            return {}
        body["max_tokens"] = min(self.opts.max_tokens, PROBE_TOKENS)
        rejected = None
        try:
            turn = self.probe_ask(e, path, body)
        except RequestFailed as exc:
            if not (exc.refused and self.asker.token_ids):
                raise self.failed_probe(e, exc) from None
            rejected = exc  # maybe only the field: asked again without it
            self.asker.token_ids = False
            body = {k: v for k, v in body.items() if k != "return_token_ids"}
            try:
                turn = self.probe_ask(e, path, body)
            except RequestFailed as exc2:
                raise self.failed_probe(e, exc2) from None
        info: dict = {"endpoint": e.url, "sample": conv.id,
                      "answers": "token_ids" if turn.token_ids else "text"}
        if turn.token_ids:
            _say(f"probe: {e.url} returns the answer's token ids: prepare trains on the ids "
                 "the target wrote")
            return info
        why = (f"it refuses return_token_ids: {rejected.kind}: {rejected.detail}; "
               "--no-token-ids skips asking" if rejected else
               "it ignores return_token_ids" if self.opts.token_ids else "--no-token-ids")
        line = (f"probe: {e.url} returns text only ({why}): prepare re-tokenizes each answer, "
                "and a text round trip can change the tokens the target wrote "
                f"({round_trip.RISKS})")
        if self.opts.target is not None:
            answer = {"role": "assistant", "content": turn.content}
            if turn.reasoning:
                answer["reasoning_content"] = turn.reasoning
            try:
                rt = round_trip.measure(self.renderer, self.opts.target, history, answer,
                                        turn.finish_reason)
            except Exception as exc:  # a model or template that cannot run this: said, not fatal
                line += f"; the round trip could not be measured ({type(exc).__name__}: {exc})"
            else:
                info["round_trip"] = rt.as_dict()
                line += "; " + rt.words(f"sample {conv.id}")
                if rt.agree < rt.total:
                    line += (": the drafter would learn the changed tokens; a server that "
                             "returns token ids (vLLM) keeps the target's own")
        else:
            line += ("; measure it here with --target TARGET_FOLDER, or after prepare with "
                     "dflash-tui data inspect DATA --target TARGET")
        _say(line)
        return info

    def probe_ask(self, e: Endpoint, path: str, body: dict) -> Turn:
        while True:
            try:
                return self.ask(e, path, body)
            except EndpointDown:
                if not self.wait_up(e):
                    raise ServerFailing(
                        f"endpoint {e.url} does not answer (waited "
                        f"{self.opts.down_wait_s:g} s); nothing was sent",
                        hint="start the server, then run the same command again") from None

    def failed_probe(self, e: Endpoint, exc: RequestFailed) -> Exception:
        if exc.refused:
            return self.refusal_error(e, exc, "refuses the first request")
        return ServerFailing(f"the first request to {e.url} failed {self.opts.retries + 1} "
                             f"times ({exc.kind}: {exc.detail}); nothing else was sent",
                             hint="see the server's log; run the same command again once it "
                                  "answers")

    # -- the samples ------------------------------------------------------------------------------
    def one(self, e: Endpoint, conv: Conversation) -> dict:
        history, turns = [], []
        for m in conv.messages:
            if m["role"] != "assistant":
                history.append(m)
                continue
            path, body = self.asker.body(history)
            turn = self.ask(e, path, body)
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
                "regenerated": {"model": self.model, "endpoint": e.url, "turns": turns}}

    def next_sample(self) -> Conversation | None:
        """The next sample to ask for; None when none is left (a sample another endpoint
        gives back while it waits is taken too)."""
        while not self.stop.is_set():
            try:
                return self.work.get(timeout=0.1)
            except queue.Empty:
                with self.lock:
                    if self.pending == 0:
                        return None
        return None

    def settled(self) -> None:
        with self.lock:
            self.pending -= 1

    def worker(self, e: Endpoint, writer, write_lock: threading.Lock) -> None:
        c = self.counts
        while not self.stop.is_set():
            if e.down_since is not None and not self.wait_up(e):
                return
            conv = self.next_sample()
            if conv is None:
                return
            try:
                row = self.one(e, conv)
            except EndpointDown:
                self.work.put(conv)  # another endpoint may take it meanwhile
                if not self.wait_up(e):
                    return
                continue
            except RequestFailed as exc:
                c.tally(c.failed, exc.kind, conv.id, str(exc))
                self.settled()
                self.show()
                if exc.refused:
                    self.refused(e, exc)
                continue
            except RowError as exc:  # its prompt cannot be rendered: left out, counted
                c.tally(c.left_out, exc.reason, conv.id, str(exc))
                with c.lock:
                    c.left_out_ids.add(conv.id)
                self.settled()
                self.show()
                continue
            except BaseException as exc:  # a model mismatch, or a bug: stop everything
                self.fatal.append(exc)
                self.stop.set()
                return
            line = json.dumps(row, ensure_ascii=False) + "\n"
            with write_lock:
                writer.write(line)
                writer.flush()
                os.fsync(writer.fileno())  # a finished sample survives a crash of this process
            with c.lock:
                c.done += 1
                for t in row["regenerated"]["turns"]:
                    c.turns += 1
                    c.with_ids += t["server_ids"]
                    c.empty += t["empty"]
                    c.prompt_tokens += t["prompt_tokens"]
                    c.completion_tokens += t["completion_tokens"]
            with self.lock:
                self.refusals = 0
            self.settled()
            self.show(add=1)

    # -- the run ----------------------------------------------------------------------------------
    def run(self, t0: float) -> dict:
        opts, out, c = self.opts, self.out, self.counts
        parts = out / PARTS
        parts.mkdir(exist_ok=True)
        done, damaged = _repair_parts(out)
        rows, malformed = [], {}
        for k, r in enumerate(read_rows(opts.source)):
            if opts.limit and k >= opts.limit:
                break
            if isinstance(r, Malformed):
                c.tally(malformed, r.reason, r.id, r.detail)
            else:
                rows.append(r)
        c.resumed = sum(r.id in done for r in rows)
        todo = [r for r in rows if r.id not in done]
        probe = self.probe(todo) if todo else {}
        self.bar = _Progress("regenerate", len(rows), "samples", enabled=opts.progress,
                             endpoints=self.endpoints)
        self.bar.done = self.bar.start_done = len(rows) - len(todo)
        for r in todo:
            self.work.put(r)
        self.pending = len(todo)
        writers = {e.name: open(parts / f"{i}-{e.name}.jsonl", "a", encoding="utf-8")
                   for i, e in enumerate(self.endpoints)}
        write_lock = threading.Lock()
        threads = [threading.Thread(target=self.worker, args=(e, writers[e.name], write_lock),
                                    daemon=True, name=f"regen-{e.name}")
                   for e in self.endpoints for _ in range(opts.concurrency)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.5)
        except KeyboardInterrupt:
            self.stop.set()
            raise
        finally:
            for fh in writers.values():
                fh.close()
            self.bar.close()
        if self.fatal:
            raise self.fatal[0]
        # Samples left in the queue: every endpoint stopped answering for longer than the wait.
        while True:
            try:
                conv = self.work.get_nowait()
            except queue.Empty:
                break
            down = [e.url for e in self.endpoints if e.gave_up]
            c.tally(c.failed, "endpoint_down", conv.id,
                    f"{', '.join(down)} did not answer for {opts.down_wait_s:g} s")

        failed = sum(c.failed.values())
        summary = {
            "model": self.model, "api": opts.api, "endpoints": [e.url for e in self.endpoints],
            "options": {"max_tokens": opts.max_tokens, "temperature": opts.temperature,
                        "thinking": opts.thinking, "concurrency": opts.concurrency,
                        "timeout_s": opts.timeout_s, "retries": opts.retries,
                        "token_ids": self.asker.token_ids},
            "probe": probe,
            "counts": {"samples": len(rows), "done_now": c.done, "resumed": c.resumed,
                       "failed": dict(sorted(c.failed.items())),
                       "request_errors": dict(sorted(c.errors.items())),
                       "retries": c.retries, "malformed": dict(sorted(malformed.items())),
                       "left_out": dict(sorted(c.left_out.items())),
                       "damaged_lines": len(damaged),
                       "turns": c.turns, "turns_with_server_ids": c.with_ids,
                       "empty_answers": c.empty},
            "examples": dict(sorted(c.examples.items())),
            "damaged": damaged[:5],
            "tokens": {"prompt": c.prompt_tokens, "completion": c.completion_tokens},
            "seconds": round(time.monotonic() - t0, 2),
            "samples_per_s": round(c.done / max(1e-9, time.monotonic() - t0), 2),
            "finished": failed == 0,
        }
        if failed == 0:
            _merge(out, [r for r in rows if r.id not in c.left_out_ids])
            write_json_atomic(out / MANIFEST, summary)
        return summary


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
