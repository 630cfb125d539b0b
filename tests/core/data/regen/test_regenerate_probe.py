"""data regenerate against servers we did not write: one probe request first (token ids or text,
said in one line; a refusal stops with the server's words and the fix), a run of identical
refusals stops the rest, an endpoint that goes down is waited for without spending retries, and
a text round trip that changes the target's tokens is measured with the target at hand."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from dflash_core.data.regen import job as regen_job
from dflash_core.data.regen.endpoint import Endpoint, RequestFailed, refusal_fix
from dflash_core.data.regen.errors import ServerRefuses
from dflash_core.data.regen.parts import MERGED
from dflash_core.data.regen.regenerate import regenerate
from dflash_core.data.shards import DataError

from tests.core.data.regen.canned_server import (
    CannedServer, Reply, convs, quick_opts, echo, strict_fields,
)


def with_ids(body):
    out = echo(body)
    out["choices"][0]["token_ids"] = [1, 2, 3]
    return out


def test_the_probe_says_in_one_line_that_the_server_returns_token_ids(tmp_path, capsys):
    with CannedServer(answer=with_ids) as srv:
        s = regenerate(quick_opts(convs(tmp_path, 4), tmp_path / "a", srv.url))
        assert srv.requests == 5 and srv.bodies[0]["max_tokens"] == regen_job.PROBE_TOKENS
    assert s["finished"] and s["probe"]["answers"] == "token_ids"
    assert s["counts"]["turns_with_server_ids"] == 4
    probe = [x for x in capsys.readouterr().err.splitlines() if x.startswith("probe:")]
    assert probe == [f"probe: {srv.url} returns the answer's token ids: prepare trains on the "
                     "ids the target wrote"]


def test_a_server_that_refuses_return_token_ids_is_asked_for_text(tmp_path, capsys):
    with CannedServer(answer=strict_fields()) as srv:
        s = regenerate(quick_opts(convs(tmp_path, 4), tmp_path / "a", srv.url))
        # the probe with the field (refused), without it, then the 4 samples without it
        assert srv.requests == 6
        assert [("return_token_ids" in b) for b in srv.bodies] == [True] + [False] * 5
    assert s["finished"] and s["counts"]["failed"] == {} and s["probe"]["answers"] == "text"
    assert s["options"]["token_ids"] is False
    err = capsys.readouterr().err
    assert ("returns text only (it refuses return_token_ids: http_422: Unexpected fields in "
            "the request: {'return_token_ids'}; --no-token-ids skips asking)") in err
    # what a text round trip may change, and how to measure it
    assert "leading whitespace" in err and "--target TARGET_FOLDER" in err


def test_token_id_prompts_refused_stop_at_the_probe_with_the_fix(tmp_path, capsys):
    from dflash_tui.cli import main

    def text_prompts_only(body):  # transformers serve's /v1/completions
        if not isinstance(body.get("prompt"), str):
            return Reply(400, {"detail": "prompt must be a string."})
        return {"choices": [{"text": "ok", "finish_reason": "stop"}]}

    src, out = convs(tmp_path, n=10), tmp_path / "a"
    with CannedServer(answer=text_prompts_only) as srv:
        with pytest.raises(ServerRefuses) as e:
            regenerate(quick_opts(src, out, srv.url, api="completions", tokenizer="builtin:tiny"))
        assert srv.requests == 2  # the probe, and again without return_token_ids
        assert "prompt must be a string." in str(e.value) and "--api chat" in e.value.hint
        code = main(["data", "regenerate", str(src), "--out", str(out), "--endpoint", srv.url,
                     "--api", "completions", "--tokenizer", "builtin:tiny", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "refuses the first request (http_400: prompt must be a string.)" in err
    assert "hint: --api completions sends the prompt as token ids" in err
    assert not (out / MERGED).exists()


def test_a_run_of_identical_refusals_stops_the_rest(tmp_path):
    asked = []

    def refuse(body):  # the probe passes, every sample is refused
        asked.append(body)
        if len(asked) == 1:
            return echo(body)
        return Reply(400, {"error": {"message": "this request is not allowed"}})

    with CannedServer(answer=refuse) as srv:
        with pytest.raises(ServerRefuses, match=r"refused 5 requests in a row with the same "
                                                r"answer \(http_400: this request is not "
                                                r"allowed\); the other samples were not sent"):
            regenerate(quick_opts(convs(tmp_path, n=40), tmp_path / "a", srv.url))
        assert srv.requests == 1 + regen_job.REFUSALS_IN_A_ROW  # not 40


def test_a_folder_where_nothing_was_generated_takes_new_settings(tmp_path, capsys):
    src, out = convs(tmp_path, 4), tmp_path / "a"
    with CannedServer(answer=lambda b: Reply(404, {"detail": "Not Found"})) as srv:
        with pytest.raises(ServerRefuses) as e:
            regenerate(quick_opts(src, out, srv.url))
    assert "use --api completions" in e.value.hint
    with CannedServer() as srv:
        s = regenerate(quick_opts(src, out, srv.url, max_tokens=64, token_ids=False))
        assert s["finished"]
        assert ("nothing was generated in this folder yet: it takes the new settings "
                "(max_tokens 2048 -> 64)") in capsys.readouterr().err
        with pytest.raises(DataError, match="other settings: max_tokens 64"):  # now it binds
            regenerate(quick_opts(src, out, srv.url, max_tokens=32))


@pytest.mark.parametrize("status,words,fix", [
    (422, "Unexpected fields in the request: {'return_token_ids'}", "--no-token-ids"),
    (400, "extra_forbidden: return_token_ids", "--no-token-ids"),
    (401, "Invalid API key", "--api-key-env"),
    (404, "The model `x` does not exist.", "--model"),
    (400, "This model's maximum context length is 4096 tokens", "lower --max-tokens"),
    (400, "something else", "the server's words above"),
])
def test_each_refusal_names_its_fix(status, words, fix):
    exc = RequestFailed(f"http_{status}", words, False, status)
    assert exc.refused and fix in refusal_fix(exc, "chat", "/v1/chat/completions", True)


def test_the_servers_words_are_read_from_its_error_shapes():
    from dflash_core.data.regen.endpoint import error_text

    assert error_text(b'{"detail": "prompt must be a string."}') == "prompt must be a string."
    assert error_text(b'{"error": {"message": "bad\\n  thing", "code": 400}}') == "bad thing"
    assert error_text(b'{"object": "error", "message": "too long"}') == "too long"
    assert error_text(b"<html>502 Bad Gateway</html>") == "<html>502 Bad Gateway</html>"


def _run_in_thread(opts):
    box: dict = {}

    def go():
        try:
            box["summary"] = regenerate(opts)
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, box


def _wait_for(cond, limit=20.0):
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < limit, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("keep_alive", [False, True])
def test_an_endpoint_that_goes_down_is_waited_for_without_spending_retries(
        tmp_path, capsys, monkeypatch, keep_alive):
    """keep_alive: the sockets the workers kept are dead once the server is back; a request
    on one is sent again on a new socket, not counted as a failure."""
    lines = []

    class Recording(regen_job._Progress):
        def update(self, *a, **kw):
            super().update(*a, **kw)
            lines.append(self.line())

    monkeypatch.setattr(regen_job, "_Progress", Recording)
    with CannedServer(delay_s=0.02, keep_alive=keep_alive) as srv:
        t, box = _run_in_thread(quick_opts(convs(tmp_path, n=30), tmp_path / "a", srv.url,
                                           concurrency=2, retries=0, backoff_s=0.05, progress=True))
        _wait_for(lambda: srv.requests >= 6)
        srv.go_down()  # connections refused: a server killed, restarting
        _wait_for(lambda: any("waiting for 127.0.0.1" in x for x in lines))
        time.sleep(0.5)
        srv.come_back()
        t.join(60)
    assert not t.is_alive() and "error" not in box, box.get("error")
    s = box["summary"]
    c = s["counts"]
    # with no retries at all, every sample done: the wait spent none
    assert s["finished"] and c["done_now"] == 30 and c["failed"] == {} and c["retries"] == 0
    assert c["request_errors"].get("connection", 0) >= 2
    err = capsys.readouterr().err
    assert "does not answer (connection refused or closed): waiting for it" in err
    assert "answers again after" in err
    # the progress line said it waited, and its error count moved while nothing was done
    waiting = [x for x in lines if "waiting for 127.0.0.1" in x]
    assert waiting and all("errors" in x for x in waiting)
    assert [json.loads(x)["id"] for x in (tmp_path / "a" / MERGED).read_text().splitlines()] \
        == [f"c{k}" for k in range(30)]


def test_an_endpoint_down_past_the_wait_leaves_its_samples_for_the_next_run(tmp_path):
    with CannedServer(delay_s=0.02) as srv:
        t, box = _run_in_thread(quick_opts(convs(tmp_path, n=30), tmp_path / "a", srv.url,
                                           retries=3, backoff_s=0.05, down_wait_s=0.5))
        _wait_for(lambda: srv.requests >= 4)
        srv.go_down()
        t.join(30)
        assert not t.is_alive() and "error" not in box, box.get("error")
        s = box["summary"]
        assert not s["finished"] and s["counts"]["retries"] == 0
        failed = s["counts"]["failed"]
        assert set(failed) == {"endpoint_down"}
        assert failed["endpoint_down"] + s["counts"]["done_now"] == 30
        assert "did not answer for 0.5 s" in s["examples"]["endpoint_down"]
        srv.come_back()
        again = regenerate(quick_opts(convs(tmp_path, n=30), tmp_path / "a", srv.url))
    assert again["finished"] and again["counts"]["resumed"] == s["counts"]["done_now"]


def test_the_progress_line_names_the_endpoint_it_waits_for():
    e = Endpoint("http://127.0.0.1:9", 1.0)
    bar = regen_job._Progress("regenerate", 10, "samples", enabled=False, endpoints=[e])
    assert "waiting" not in bar.line()
    e.down_since, e.next_try = time.monotonic() - 42, time.monotonic() + 8.4
    assert bar.line().endswith(", waiting for 127.0.0.1:9 (down 0:42, next try in 8 s)")


def test_a_server_that_strips_leading_whitespace_is_measured_with_the_target(
        tmp_path, demo_target, capsys):
    """The demo target answers these prompts with a leading space; a server that strips it
    changes the first token the drafter would learn, and the probe's measure says so."""
    from dflash_core import demo
    from dflash_core.demo.server import DemoServer

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{k}", "messages": [
        {"role": "user", "content": p}, {"role": "assistant", "content": "old"}]}) + "\n"
        for k, p in enumerate(["The value of", "Use the"])))
    model = demo.load_lm(demo_target)
    gen = DemoServer(demo_target)

    def serve(strip):
        def answer(body):
            out = gen.answer("/v1/chat/completions", dict(body, model="canned"))
            out["choices"][0].pop("token_ids", None)  # a server that returns text only
            msg = out["choices"][0]["message"]
            msg["content"] = msg["content"].lstrip() if strip else msg["content"]
            return out
        return answer

    shares = {}
    for strip in (False, True):
        with CannedServer(answer=serve(strip)) as srv:
            s = regenerate(quick_opts(src, tmp_path / f"out-{strip}", srv.url, max_tokens=12,
                                      target=model, tokenizer="builtin:tiny"))
        assert s["finished"] and s["probe"]["answers"] == "text"
        shares[strip] = s["probe"]["round_trip"]
    assert shares[False]["agree"] == shares[False]["positions"] > 5  # the text is the target's
    rt = shares[True]
    assert rt["agree"] < rt["positions"]
    assert rt["first_difference"] == [0, "t", " "]  # the first answer token: ' ' was stripped
    # the measure travels with the folder's record, for prepare and the run's data finding
    record = json.loads((tmp_path / "out-True" / "dflash_regen.json").read_text())["provenance"]
    assert record["round_trip"] == dict(rt, sample="p0") and record["answers"] == "text"
    err = capsys.readouterr().err
    assert "first difference at answer token 0: the text gives 't', the target writes ' '" in err
    assert "a server that returns token ids (vLLM) keeps the target's own" in err


def test_a_server_rate_limiting_the_probe_is_named_so_and_its_retry_after_is_waited(tmp_path,
                                                                                  monkeypatch):
    # It said "see the server's log": the server was telling us to slow down.
    from dflash_core.data.regen.errors import ServerFailing
    limited = Reply(429, {"error": {"message": "too many requests"}}, {"Retry-After": "0.25"})
    waits: list[float] = []
    real_wait = threading.Event.wait
    monkeypatch.setattr(threading.Event, "wait",
                        lambda self, t=None: (waits.append(t), real_wait(self, 0))[1])
    with CannedServer(answers=[limited] * 3) as srv:
        with pytest.raises(ServerFailing) as e:
            regenerate(quick_opts(convs(tmp_path, 2), tmp_path / "out", srv.url, retries=2))
        assert srv.requests == 3  # the probe and its two retries, nothing else
    assert "is rate limiting: the first request was answered HTTP 429 3 times" in str(e.value)
    assert "--concurrency" in e.value.hint and "--retries" in e.value.hint
    assert waits.count(0.25) == 2  # each retry waited what the server asked (backoff_s is 0)


@pytest.mark.parametrize("value, seconds", [("2", 2.0), ("0.5", 0.5), (None, None),
                                            ("Wed, 21 Oct 2026 07:28:00 GMT", None),
                                            ("-1", None), ("99999", None)])
def test_retry_after_reads_seconds_and_nothing_else(value, seconds):
    from dflash_core.data.regen.endpoint import retry_after
    assert retry_after(value) == seconds


def test_answers_cut_at_max_tokens_are_counted_and_said(tmp_path, capsys):
    # Every answer ended with finish_reason "length" and was merged without a word.
    from dflash_tui.cli import main

    def cut(body):
        out = echo(body)
        out["choices"][0]["finish_reason"] = "length"
        return out

    with CannedServer(answer=cut) as srv:
        assert main(["data", "regenerate", str(convs(tmp_path, 3)), "--out",
                     str(tmp_path / "out"), "--endpoint", srv.url, "--max-tokens", "64",
                     "--concurrency", "1", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert ("3 of 3 answers written now were cut at --max-tokens 64 (finish_reason \"length\")"
            in err), (out, err)
    assert "raise --max-tokens" in err
    summary = json.loads((tmp_path / "out" / "dflash_regen.json").read_text())
    assert summary["counts"]["answers_cut"] == 3


def test_an_answer_cut_before_its_content_length_is_a_connection_error():
    """A server killed while it writes an answer: the headers came, the body did not. That is
    the server going down (waited for, no retry spent), never an answer that is not JSON."""
    import socket

    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)

    def serve():
        conn, _ = lst.accept()
        got = b""  # the whole request read: a close with bytes unread would be a reset instead
        while b"\r\n\r\n" not in got:
            got += conn.recv(65536)
        head, body = got.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
        while len(body) < length:
            body += conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"choi")
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    e = Endpoint(f"http://127.0.0.1:{lst.getsockname()[1]}", timeout_s=5.0)
    with pytest.raises(RequestFailed) as info:
        e.request("POST", "/v1/chat/completions", {"messages": []})
    t.join(5)
    lst.close()
    assert info.value.kind == "connection" and "IncompleteRead" in info.value.detail
