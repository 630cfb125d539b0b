"""regenerate records where its answers came from (text or token ids, the model and the server,
what the probe found) in its folder's dflash_regen.json, over every merged row, so prepare can
carry it to the run's data finding (issue 48 item 9)."""

from __future__ import annotations

import json

from dflash_core.data.conversations import source_fingerprint
from dflash_core.data.regen.parts import MANIFEST, MERGED
from dflash_core.data.regen.regenerate import regenerate

from tests.core.data.regen.canned_server import (
    MODEL, CannedServer, Reply, convs, echo, quick_opts, strict_fields,
)


def record(out):
    return json.loads((out / MANIFEST).read_text())["provenance"]


def with_ids(body):
    out = echo(body)
    out["choices"][0]["token_ids"] = [1, 2, 3]
    return out


def test_a_text_only_server_is_recorded_with_why_and_the_file_it_describes(tmp_path):
    out = tmp_path / "a"
    vllm_like = {"object": "list", "data": [{"id": MODEL, "object": "model",
                                             "owned_by": "someone"}]}
    with CannedServer(answer=strict_fields(), models=vllm_like) as srv:
        assert regenerate(quick_opts(convs(tmp_path, 4), out, srv.url,
                                     temperature=0.5))["finished"]
    rec = record(out)
    assert rec["answers"] == "text" and (rec["answers_as_text"], rec["answers_as_token_ids"]) \
        == (4, 0)
    assert rec["model"] == MODEL and rec["endpoints"] == [srv.url] and rec["api"] == "chat"
    assert rec["served_by"] == {srv.url: "someone"}  # /v1/models' owned_by
    assert rec["temperature"] == 0.5
    assert rec["text_only_because"].startswith("it refuses return_token_ids: http_422")
    assert rec["round_trip"] is None  # no target at hand: not measured
    assert rec["conversations_fingerprint"] == source_fingerprint([out / MERGED])


def test_a_server_that_ignores_the_field_and_one_that_returns_ids(tmp_path):
    with CannedServer() as srv:  # echo: answers text, says nothing of return_token_ids
        regenerate(quick_opts(convs(tmp_path, 2), tmp_path / "text", srv.url))
    assert record(tmp_path / "text")["text_only_because"] == "it ignores return_token_ids"
    with CannedServer(answer=with_ids) as srv:
        regenerate(quick_opts(convs(tmp_path, 2), tmp_path / "ids", srv.url))
    rec = record(tmp_path / "ids")
    assert rec["answers"] == "token_ids" and rec["answers_as_token_ids"] == 2
    assert rec["text_only_because"] is None


def test_the_record_counts_every_merged_row_not_only_this_runs(tmp_path):
    # The first run: the probe, one sample, then a refusal of the next: left for the next run.
    src, out = convs(tmp_path, 4), tmp_path / "a"
    with CannedServer(answers=[None, None, Reply(500, {"detail": "boom"})]) as srv:
        s = regenerate(quick_opts(src, out, srv.url))
    assert not s["finished"] and not (out / MANIFEST).exists()
    with CannedServer() as srv:
        s = regenerate(quick_opts(src, out, srv.url))
    assert s["finished"] and s["counts"]["resumed"] >= 1 and s["counts"]["done_now"] < 4
    assert record(out)["answers_as_text"] == 4  # every merged row, the first run's too
    # run again with nothing left to ask (no probe): the record stands, with its findings
    with CannedServer() as srv:
        s = regenerate(quick_opts(src, out, srv.url))
        assert srv.requests == 0
    rec = record(out)
    assert rec["answers_as_text"] == 4 and rec["text_only_because"] == \
        "it ignores return_token_ids"
