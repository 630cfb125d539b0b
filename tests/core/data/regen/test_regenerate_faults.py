"""data regenerate against what goes wrong: damaged lines of its parts (anywhere, not only the
last), answers a server should never give, an unreadable settings file, an output that is its
input, rows whose prompt cannot be rendered. Against a canned server: fast, no model."""

from __future__ import annotations

import json
import re

import pytest

from dflash_core.data.regen.parts import DAMAGED, MERGED, PARTS, STATE
from dflash_core.data.regen.regenerate import regenerate
from dflash_core.data.shards import DataError

from tests.core.data.regen.canned_server import CannedServer, convs, quick_opts


def _merged(out):
    return [json.loads(line) for line in (out / MERGED).read_text().splitlines()]


def test_a_damaged_line_in_the_middle_of_a_part_is_set_aside_and_its_sample_redone(tmp_path):
    src, out = convs(tmp_path, 5), tmp_path / "regen"
    with CannedServer() as srv:
        assert regenerate(quick_opts(src, out, srv.url))["finished"]
        part = next((out / PARTS).glob("*.jsonl"))
        lines = part.read_bytes().split(b"\n")
        # a control character in a string (the JSONDecodeError) and a byte not UTF-8
        lines[1] = lines[1].replace(b"question", b"ques\x01tion", 1)
        lines[3] = lines[3].replace(b"question", b"ques\xfftion", 1)
        part.write_bytes(b"\n".join(lines))
        ids = [json.loads(lines[k])["id"] for k in (0, 2, 4)]
        before = srv.requests
        s = regenerate(quick_opts(src, out, srv.url))
        assert s["finished"] and s["counts"]["damaged_lines"] == 2
        # only the damaged lines' samples asked again (and the probe, one request first)
        assert srv.requests - before == 3
        assert s["counts"]["resumed"] == 3 and s["counts"]["done_now"] == 2
        assert "line 2" in s["damaged"][0] and "control character" in s["damaged"][0]
        assert "not UTF-8" in s["damaged"][1]
        kept = (out / DAMAGED).read_bytes()
        assert b"ques\x01tion" in kept and b"ques\xfftion" in kept  # kept for a look
        rows = _merged(out)
        assert [r["id"] for r in rows] == [f"c{k}" for k in range(5)]
        assert all(r["messages"][1]["content"] == f"question {k}"[::-1]
                   for k, r in enumerate(rows))
        assert all(i in {r["id"] for r in rows} for i in ids)
        again = regenerate(quick_opts(src, out, srv.url))  # repaired for good; nothing to ask
        assert again["counts"]["damaged_lines"] == 0 and srv.requests - before == 3


def test_the_verb_reports_the_repair_in_one_line_and_exits_0(tmp_path, capsys):
    from dflash_tui.cli import main

    src, out = convs(tmp_path, n=3), tmp_path / "regen"
    with CannedServer() as srv:
        argv = ["data", "regenerate", str(src), "--out", str(out), "--endpoint", srv.url,
                "--quiet"]
        assert main(argv) == 0
        part = next((out / PARTS).glob("*.jsonl"))
        data = part.read_bytes()
        part.write_bytes(data.replace(b'"id"', b'"id\x02"', 1))
        assert main(argv) == 0
    out_, err = capsys.readouterr()
    assert "Traceback" not in out_ + err
    assert "repaired 1 damaged lines" in err and "line 1" in err and DAMAGED in err


BAD_ANSWERS = {
    "message is a string": {"model": "canned", "choices": [{"message": "hi"}]},
    "no choices": {"model": "canned", "choices": []},
    "choices[0] a list": {"model": "canned", "choices": [["x"]]},
    "content a number": {"model": "canned", "choices": [{"message": {"content": 3}}]},
    "token ids not ids": {"model": "canned", "choices": [{"message": {"content": "a"},
                                                          "token_ids": ["a", -1]}]},
    "reasoning a dict": {"model": "canned", "choices": [{"message": {
        "content": "a", "reasoning_content": {"x": 1}}}]},
    "not JSON": b"<html>busy</html>",
    "a JSON list": b"[1, 2]",
}


def test_answers_that_cannot_be_used_are_counted_with_an_example_and_retried(tmp_path):
    src = convs(tmp_path, n=len(BAD_ANSWERS))
    with CannedServer([None, *BAD_ANSWERS.values()]) as srv:  # the probe's answer is good
        s = regenerate(quick_opts(src, tmp_path / "a", srv.url, retries=0))
        assert not s["finished"]
        assert s["counts"]["failed"] == {"bad_response": len(BAD_ANSWERS)}
        assert s["examples"]["bad_response"].startswith("c")  # the sample id, then why
        assert not (tmp_path / "a" / MERGED).exists()
        s = regenerate(quick_opts(src, tmp_path / "a", srv.url))  # the server is sane again
    assert s["finished"] and len(_merged(tmp_path / "a")) == len(BAD_ANSWERS)


def test_usage_of_the_wrong_type_is_not_an_error(tmp_path):
    odd = {"model": "canned", "choices": [{"message": {"content": "fine"},
                                           "finish_reason": 7}],
           "usage": {"prompt_tokens": "many", "completion_tokens": None}}
    with CannedServer([odd, odd]) as srv:  # the probe's, then the sample's
        s = regenerate(quick_opts(convs(tmp_path, n=1), tmp_path / "a", srv.url))
    assert s["finished"] and _merged(tmp_path / "a")[0]["messages"][1]["content"] == "fine"


def test_the_verb_names_the_failed_samples_and_exits_1(tmp_path, capsys):
    from dflash_tui.cli import main

    with CannedServer([None, {"choices": []}, {"choices": []}]) as srv:
        code = main(["data", "regenerate", str(convs(tmp_path, n=2)), "--out",
                     str(tmp_path / "a"), "--endpoint", srv.url, "--retries", "0", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in out + err
    assert "2 samples failed (bad_response: 2 (e.g. c" in err and "no choices" in err


def test_an_unreadable_settings_file_is_refused_in_one_line(tmp_path, capsys):
    from dflash_tui.cli import main

    src, out = convs(tmp_path, n=1), tmp_path / "regen"
    with CannedServer() as srv:
        argv = ["data", "regenerate", str(src), "--out", str(out), "--endpoint", srv.url,
                "--quiet"]
        assert main(argv) == 0
        (out / STATE).write_bytes(b"\x00garbage")
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"unreadable {STATE}" in err and "hint: pass another --out" in err
    assert "Traceback" not in err


def test_an_output_that_is_or_holds_its_input_is_refused_before_asking(tmp_path):
    src = convs(tmp_path, n=1)
    with CannedServer() as srv:
        for out, words in ((tmp_path, "holds the conversations source"),
                           (src, "is the conversations source itself")):
            with pytest.raises(DataError, match=words):
                regenerate(quick_opts(src, out, srv.url))
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.txt").write_text("keep")
        with pytest.raises(DataError, match="no data verb wrote .*notes.txt"):
            regenerate(quick_opts(src, tmp_path / "mine", srv.url))
        assert srv.requests == 0
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_row_whose_prompt_cannot_be_rendered_is_left_out_and_counted(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}{% if 'BOOM' in m.content %}{{ raise_exception('no BOOM') }}"
        "{% endif %}{{ m.content }}{% endfor %}")
    bad = {"id": "boom", "messages": [{"role": "user", "content": "BOOM"},
                                      {"role": "assistant", "content": "x"}]}

    def complete(body):
        return {"model": "canned", "choices": [{"text": "ok", "finish_reason": "stop"}]}

    with CannedServer(answer=complete) as srv:
        s = regenerate(quick_opts(convs(tmp_path, n=2, extra=[bad]), tmp_path / "a", srv.url,
                                  api="completions", tokenizer="builtin:tiny",
                                  chat_template=template))
    assert s["finished"] and s["counts"]["left_out"] == {"template_error": 1}
    assert s["examples"]["template_error"].startswith("boom: ")
    assert [r["id"] for r in _merged(tmp_path / "a")] == ["c0", "c1"]


def test_bad_numbers_given_to_the_function_are_refused_together(tmp_path):
    with pytest.raises(DataError) as e:
        regenerate(quick_opts(convs(tmp_path, n=1), tmp_path / "a", "http://127.0.0.1:9",
                              concurrency=0, timeout_s=float("nan"), limit=-1))
    msg = str(e.value)
    assert "concurrency must be >= 1" in msg and "timeout_s" in msg and "limit" in msg


def test_an_endpoint_that_is_not_a_url_is_one_line(tmp_path):
    with pytest.raises(DataError, match="is not a URL"):
        regenerate(quick_opts(convs(tmp_path, n=1), tmp_path / "a", "http://[::1"))
    with pytest.raises(DataError, match="is not a URL"):
        regenerate(quick_opts(convs(tmp_path, n=1), tmp_path / "a", "http://host:99999"))


@pytest.mark.parametrize("models,words", [
    ({"data": 5}, "without a list of models"),
    ({"object": "list"}, "without a list of models"),
    (b"<html>", "does not answer /v1/models"),
    ({"data": []}, "lists no model"),
    ({"data": [{"id": "other"}]}, "serves ['other'], not 'canned'"),
])
def test_a_models_answer_that_cannot_be_used_is_one_line(tmp_path, models, words):
    with CannedServer(models=models) as srv:
        with pytest.raises(DataError, match=re.escape(words)) as e:
            regenerate(quick_opts(convs(tmp_path, n=1), tmp_path / "a", srv.url,
                                  model="canned" if "serves" in words else None))
        assert srv.requests == 0
    assert e.value.hint and not (tmp_path / "a").exists()


def test_a_second_regenerate_of_one_folder_is_refused_naming_the_first(tmp_path):
    from dflash_core.data.lock import OutputBusy, OutputLock

    src, out = convs(tmp_path, n=2), tmp_path / "regen"
    with CannedServer() as srv:
        with OutputLock(out, "regenerate"):  # the first, still asking
            with pytest.raises(OutputBusy, match="another process is writing this folder "
                                                 r"\(data regenerate, pid"):
                regenerate(quick_opts(src, out, srv.url))
        assert regenerate(quick_opts(src, out, srv.url))["finished"]
