"""The data verbs end to end against a real third-party OpenAI-compatible server, `transformers
serve`, as a new user runs them (README, docs/data.md): a tiny Qwen3 chat model with its own
GPT-2-style byte-level BPE and ChatML template, made here, served on 127.0.0.1.

What that server does that ours does not: it refuses the field return_token_ids (HTTP 422), takes
only text prompts on /v1/completions (HTTP 400), and strips an answer's leading whitespace. The
fast versions of each check run against the scriptable server (test_regenerate_probe.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from dflash_tui.cli import main

from tests.core.data.hf_serve import ANSWER, make_chat_model, transformers_serve

pytestmark = pytest.mark.slow  # a model trained for seconds, a server started twice: ~30 s


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("tiny-qwen3"))


def _convs(path, n):
    # answers written by someone else, indented: the BPE merges the template's newline with them
    path.write_text("".join(json.dumps({"id": f"c{k}", "messages": [
        {"role": "user", "content": f"task {k}"},
        {"role": "assistant", "content": f"    pass  # {k}"}]}) + "\n" for k in range(n)))
    return path


def test_regenerate_prepare_inspect_against_transformers_serve(tmp_path, model, capsys):
    src = _convs(tmp_path / "convs.jsonl", 12)
    log = tmp_path / "serve.log"
    with transformers_serve(model, log) as url:
        # the default command: the probe finds the field refused and asks for text; the
        # target at hand measures what the text round trip changes
        assert main(["data", "regenerate", str(src), "--endpoint", url, "--out",
                     str(tmp_path / "regen"), "--max-tokens", "24", "--target", str(model),
                     "--quiet"]) == 0
        out, err = capsys.readouterr()
        assert (f"probe: {url} returns text only (it refuses return_token_ids: http_422: "
                "Unexpected fields in the request: {'return_token_ids'}") in err
        # the server stripped the answer's leading spaces: the first token differs
        assert "first difference at answer token 0" in err and "the target writes '   '" in err
        assert "regenerated 12 samples now" in out and "answers as text" in out
        rows = [json.loads(x) for x in (tmp_path / "regen" / "conversations.jsonl")
                .read_text().splitlines()]
        assert [r["messages"][1]["content"] for r in rows] == [ANSWER.lstrip()] * 12

        # --api completions: this server takes text prompts only; stopped at the probe
        assert main(["data", "regenerate", str(src), "--endpoint", url, "--out",
                     str(tmp_path / "regen2"), "--api", "completions", "--tokenizer",
                     str(model), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert "(http_400: prompt must be a string.)" in err and "use --api chat" in err
        assert "Traceback" not in err

        # the server killed mid-run and started again on its port: the run waits, no
        # retries spent, and finishes
        port = int(url.rsplit(":", 1)[1])
        more = _convs(tmp_path / "more.jsonl", 40)
        box = {}
        t = threading.Thread(target=lambda: box.update(code=main([
            "data", "regenerate", str(more), "--endpoint", url, "--out",
            str(tmp_path / "regen3"), "--max-tokens", "24", "--retries", "0", "--quiet"])))
        t.start()
        parts = tmp_path / "regen3" / "parts"
        t0 = time.monotonic()
        while not (parts.is_dir() and sum(len(p.read_text().splitlines())
                                          for p in parts.glob("*.jsonl")) >= 3):
            assert time.monotonic() - t0 < 60 and t.is_alive()
            time.sleep(0.05)
    assert t.is_alive()  # the server is gone; the run waits for it
    with transformers_serve(model, log, port=port):
        t.join(120)
    assert box.get("code") == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "does not answer (connection refused or closed): waiting for it" in err
    assert "answers again after" in err

    # prepare: the originals (indented: merged across the boundary) and the regenerated data
    assert main(["data", "prepare", str(src), "--tokenizer", str(model), "--out",
                 str(tmp_path / "orig"), "--quiet", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "prepared 12 samples from 12 rows" in out and "left out" not in out
    assert "12 conversations tokenized piece by piece at the turn boundaries" in out
    assert main(["data", "prepare", str(tmp_path / "regen" / "conversations.jsonl"),
                 "--tokenizer", str(model), "--out", str(tmp_path / "data"), "--quiet",
                 "--workers", "1"]) == 0
    assert "prepared 12 samples from 12 rows" in capsys.readouterr().out

    # inspect: the regenerated answers are (all but the stripped first token) the target's;
    # the same figure every time
    reports = []
    for folder in ("data", "data", "orig"):
        assert main(["data", "inspect", str(tmp_path / folder), "--target", str(model),
                     "--json", "--agreement-samples", "4", "--samples", "0"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    regen, again, orig = (r["agreement"] for r in reports)
    print("agreement: regenerated", regen["share"], "originals", orig["share"])
    assert regen == again
    assert 0.7 < regen["share"] < 1.0 and orig["share"] < regen["share"] - 0.3

    # where the answers came from travels with the data (issue 48 item 9): the run's data
    # finding names the text round trip and what helps, not "written by another model"
    from dflash_core.acceptance import data_cause
    from dflash_core.data.provenance import of_manifest
    prov = of_manifest(reports[0]["manifest"])
    assert prov["answers"] == "text" and prov["regenerated_rows"] == 12
    rt = prov["regeneration"]["round_trip"]  # regenerate's probe, measured with --target
    assert rt["first_difference"][0] == 0 and rt["agree"] < rt["positions"]
    cause, fix = data_cause(prov, regen["share"])
    print("the finding's cause:", cause)
    assert "came back as text only" in cause and "return_token_ids" in fix
    assert "another model" not in cause and "a few tokens per answer" not in cause
    assert "written by another model" in data_cause(of_manifest(reports[2]["manifest"]))[0]
