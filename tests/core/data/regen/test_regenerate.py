"""data regenerate against a small OpenAI-compatible server started here on 127.0.0.1, which
generates with the demo target (greedy decoding of the tiny model, not canned answers)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from dflash_core import demo
from dflash_core.data.byte_vocab import EOS_ID, byte_tokenizer
from dflash_core.demo.chat import write_demo_conversations
from dflash_core.demo.server import DemoServer
from dflash_core.data.regen.errors import ModelMismatch, ServerFailing
from dflash_core.data.regen.options import RegenOptions
from dflash_core.data.regen.parts import MERGED, PARTS
from dflash_core.data.regen.regenerate import regenerate
from dflash_core.data.shards import DataError

N_TOKENS = 12


def opts(src, out, url, **kw) -> RegenOptions:
    base = dict(max_tokens=N_TOKENS, concurrency=2, timeout_s=20, backoff_s=0.01,
                progress=False)
    base.update(kw)
    return RegenOptions(src, out, [url] if isinstance(url, str) else url, **base)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_demo_conversations(tmp_path_factory.mktemp("conv") / "c.jsonl", n=6)


def _rows(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_each_turn_is_the_targets_own_greedy_answer(tmp_path, src, demo_target):
    with DemoServer(demo_target) as srv:
        s = regenerate(opts(src, tmp_path / "out", srv.url, api="completions",
                            tokenizer="builtin:tiny"))
    assert s["finished"] and s["counts"]["done_now"] == 6
    assert s["counts"]["turns_with_server_ids"] == 6
    rows = _rows(tmp_path / "out" / MERGED)
    assert [r["id"] for r in rows] == [f"demo-{k}" for k in range(6)]  # source order
    source = _rows(src)
    model = demo.load_lm(demo_target)
    tok = byte_tokenizer()
    for r, orig in zip(rows[:2], source):
        prompt = tok(orig["messages"][0]["content"], add_special_tokens=False)["input_ids"]
        want = demo.greedy_continue(model, torch.tensor([prompt]), N_TOKENS)[0].tolist()
        if EOS_ID in want:
            want = want[:want.index(EOS_ID) + 1]
        assert r["messages"][1]["token_ids"] == want
        assert r["messages"][1]["content"] != orig["messages"][1]["content"]


def test_chat_api_multi_turn_is_conditioned_on_the_regenerated_history(tmp_path, demo_target):
    src = tmp_path / "two.jsonl"
    src.write_text(json.dumps({"id": "t", "messages": [
        {"role": "user", "content": "The value of "}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": " and the "}, {"role": "assistant", "content": "y"}]}) + "\n")
    with DemoServer(demo_target) as srv:
        s = regenerate(opts(src, tmp_path / "out", srv.url))
        [row] = _rows(tmp_path / "out" / MERGED)
        first = row["messages"][1]["content"]
        # the second turn as the server answers it given the regenerated first turn
        hist = [{"role": "user", "content": "The value of "},
                {"role": "assistant", "content": first}, {"role": "user", "content": " and the "}]
        want = srv.answer("/v1/chat/completions", {"model": srv.name, "messages": hist,
                                                    "max_tokens": N_TOKENS})
    assert s["counts"]["turns"] == 2
    assert row["messages"][3]["content"] == want["choices"][0]["message"]["content"]


def test_a_rerun_continues_by_sample_id(tmp_path, src, demo_target):
    with DemoServer(demo_target) as srv:
        first = regenerate(opts(src, tmp_path / "out", srv.url, limit=2))
        assert first["finished"]
        # a crash mid-write leaves a torn last line: it is cut, and that sample is done again
        part = next((tmp_path / "out" / PARTS).glob("*.jsonl"))
        with open(part, "a") as fh:
            fh.write('{"id": "demo-2", "messa')
        with pytest.raises(DataError, match="other settings"):
            regenerate(opts(src, tmp_path / "out", srv.url, limit=0, max_tokens=5))
        before = srv.requests
        s = regenerate(opts(src, tmp_path / "out", srv.url, limit=2))
        assert srv.requests == before and s["counts"]["resumed"] == 2
    rows = _rows(tmp_path / "out" / MERGED)
    assert [r["id"] for r in rows] == ["demo-0", "demo-1"]


def test_errors_and_a_server_that_hangs_past_the_timeout_are_retried(tmp_path, src,
                                                                      demo_target):
    # 2 answers are errors, then one request hangs past the timeout, then the server is back
    # (a timeout well above a normal answer's time, even on a loaded machine)
    with DemoServer(demo_target, fail_first=2, hang_first=1, hang_s=6.0) as srv:
        s = regenerate(opts(src, tmp_path / "out", srv.url, concurrency=1, timeout_s=3.0))
    c = s["counts"]
    assert s["finished"] and c["done_now"] == 6
    assert c["request_errors"] == {"http_500": 2, "timeout": 1} and c["retries"] == 3


def test_an_answer_that_trickles_in_past_the_timeout_is_a_timeout(tmp_path, src, demo_target):
    # A byte every 0.2 s: no single read waits long, the whole answer would take minutes.
    with DemoServer(demo_target, trickle_first=1, trickle_s=0.2) as srv:
        t = time.monotonic()
        s = regenerate(opts(src, tmp_path / "out", srv.url, concurrency=1, timeout_s=2.0))
        took = time.monotonic() - t
    c = s["counts"]
    assert s["finished"] and c["done_now"] == 6
    assert c["request_errors"] == {"timeout": 1} and c["retries"] == 1
    assert took < 60  # the trickled answer alone is hundreds of bytes x 0.2 s


def test_a_server_failing_the_probe_past_its_retries_is_sent_nothing_else(tmp_path, src,
                                                                         demo_target):
    with DemoServer(demo_target, fail_first=1000) as srv:
        with pytest.raises(ServerFailing, match=r"the first request .* failed 2 times "
                                                r"\(http_500: injected failure\); nothing else"):
            regenerate(opts(src, tmp_path / "out", srv.url, retries=1))
        assert srv.requests == 2  # the probe and its retry, not 6 samples x 2
        assert not (tmp_path / "out" / MERGED).exists()  # never a silent hole
        srv.fail_left = 0  # the server is healthy again: the same command finishes the job
        s = regenerate(opts(src, tmp_path / "out", srv.url))
    assert s["finished"] and len(_rows(tmp_path / "out" / MERGED)) == 6


def test_a_server_of_another_model_is_refused(tmp_path, src, demo_target):
    with DemoServer(demo_target, name="other-model") as srv:
        with pytest.raises(ModelMismatch, match="serves"):
            regenerate(opts(src, tmp_path / "a", srv.url, model="dflash-demo"))
    with DemoServer(demo_target, answer_as="impostor") as srv:
        with pytest.raises(ModelMismatch, match="impostor"):
            regenerate(opts(src, tmp_path / "b", srv.url))
        assert srv.requests == 1  # the probe found it
    assert not any(p.read_text() for p in (tmp_path / "b" / PARTS).glob("*.jsonl"))


def test_regenerated_data_prepares_and_agrees_with_the_target(tmp_path, src, demo_target):
    from dflash_core.data.inspect import inspect
    from dflash_core.data.prepare import PrepareOptions, prepare

    with DemoServer(demo_target) as a, DemoServer(demo_target) as b:
        s = regenerate(opts(src, tmp_path / "regen", [a.url, b.url], concurrency=1,
                            max_tokens=16))
        assert s["finished"] and a.requests > 0 and b.requests > 0  # both endpoints worked
    m = prepare(PrepareOptions(tmp_path / "regen" / MERGED, tmp_path / "data", workers=1,
                               progress=False))
    assert m["counts"]["server_ids_turns"] == m["counts"]["samples"] > 0
    model = demo.load_lm(demo_target)
    regen = inspect(tmp_path / "data", target=model, tokenizer=byte_tokenizer(),
                    agreement_samples=6)
    prepare(PrepareOptions(src, tmp_path / "human", workers=1, progress=False))
    human = inspect(tmp_path / "human", target=model, agreement_samples=6)
    print("agreement", regen["agreement"], human["agreement"])
    # the target's own greedy answers agree with its greedy next token (EOS after the length
    # cut is the template's, not the target's); the human-written text far less
    assert regen["agreement"]["share"] > 0.9
    assert human["agreement"]["share"] < regen["agreement"]["share"] - 0.15
    assert "[[" in regen["shown"][0]["text"]
