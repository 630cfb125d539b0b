"""One run of ``data regenerate`` over the samples left: the probe request first, then
``concurrency`` workers per endpoint taking samples from one queue, with retries and backoff, the
waits for an endpoint that stopped answering, the refusals that stop the run, the progress line
and the counts of the summary."""

from __future__ import annotations

import json
import os
import queue
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_core.data import round_trip
from dflash_core.data.conversations import (
    Conversation, Malformed, RowError, read_rows, source_fingerprint,
)
from dflash_core.data.regen.endpoint import Endpoint, RequestFailed, refusal_fix
from dflash_core.data.manifest import write_json_atomic
from dflash_core.data.progress import ProgressLine
from dflash_core.data.regen.errors import ServerFailing, ServerRefuses
from dflash_core.data.regen.options import RegenOptions
from dflash_core.data.provenance import regen_record
from dflash_core.data.regen.parts import MANIFEST, MERGED, PARTS, merge, repair_parts
from dflash_core.data.regen.turn import Asker, Turn

PROBE_TOKENS = 32  # the probe's answer: enough to see the server's ways, short to wait for
PROBE_ROWS = 16  # rows tried for a probe whose prompt renders
REFUSALS_IN_A_ROW = 5  # identical 4xx answers in a row that stop a run


class EndpointDown(Exception):
    """A request found its endpoint not answering at all: wait for it, spend no retry."""


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
    cut: int = 0  # answers the server ended at --max-tokens (finish_reason "length")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tally(self, into: dict, key: str, rid: str, detail: str) -> None:
        with self.lock:
            into[key] = into.get(key, 0) + 1
            self.examples.setdefault(key, f"{rid}: {detail}"[:300])


def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def say(text: str) -> None:
    print(text, file=sys.stderr)


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


class Job:
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
                if exc.retry_after_s is not None:  # the server said how long: wait that long
                    delay = max(delay, exc.retry_after_s)
                self.stop.wait(delay)
        raise AssertionError("unreachable")

    def wait_up(self, e: Endpoint) -> bool:
        return e.wait_up(self.stop, self.opts.down_wait_s, self.opts.backoff_s,
                         self.count_error, note)

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
            say(f"probe: {e.url} returns the answer's token ids: prepare trains on the ids "
                 "the target wrote")
            return info
        why = (f"it refuses return_token_ids: {rejected.kind}: {rejected.detail}; "
               "--no-token-ids skips asking" if rejected else
               "it ignores return_token_ids" if self.opts.token_ids else "--no-token-ids")
        info["text_only_because"] = why
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
        say(line)
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
        if exc.rate_limited:
            return ServerFailing(
                f"{e.url} is rate limiting: the first request was answered HTTP 429 "
                f"{self.opts.retries + 1} times ({exc.detail}); nothing else was sent",
                hint="send fewer requests at once (--concurrency) or retry more often "
                     "(--retries), or raise the server's rate limit; then run the same command "
                     "again")
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
                    c.cut += t["finish_reason"] == "length"
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
        done, damaged = repair_parts(out)
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
                       "empty_answers": c.empty, "answers_cut": c.cut},
            "examples": dict(sorted(c.examples.items())),
            "damaged": damaged[:5],
            "tokens": {"prompt": c.prompt_tokens, "completion": c.completion_tokens},
            "seconds": round(time.monotonic() - t0, 2),
            "samples_per_s": round(c.done / max(1e-9, time.monotonic() - t0), 2),
            "finished": failed == 0,
        }
        if failed == 0:
            text, ids = merge(out, [r for r in rows if r.id not in c.left_out_ids])
            summary["provenance"] = self.provenance(probe, text, ids)
            write_json_atomic(out / MANIFEST, summary)
        return summary

    def provenance(self, probe: dict, text: int, ids: int) -> dict:
        """Where the merged answers came from (``provenance.regen_record``)."""
        rt = probe.get("round_trip")
        found = {"text_only_because": probe.get("text_only_because"),
                 "round_trip": dict(rt, sample=probe.get("sample")) if rt else None}
        if not probe:  # nothing was left to ask, so no probe: the last record's findings stand
            try:
                last = json.loads((self.out / MANIFEST).read_text(encoding="utf-8"))
                found = {k: last["provenance"].get(k) for k in found}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass
        served_by = {e.url: e.owned_by[self.model] for e in self.endpoints
                     if self.model in e.owned_by}
        return regen_record(model=self.model, api=self.opts.api,
                            endpoints=[e.url for e in self.endpoints], served_by=served_by,
                            options=self.opts, text=text, ids=ids, **found,
                            conversations_fingerprint=source_fingerprint([self.out / MERGED]))
