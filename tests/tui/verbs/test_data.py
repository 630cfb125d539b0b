"""`dflash-tui data inspect`: the verb resolves its --target (builtin:tiny or a model folder) and
measures how often the trained labels are the target's own greedy next token."""

import json

from dflash_tui.cli import main


def test_inspect_measures_agreement_with_the_builtin_target_and_with_its_folder(
        demo_data, demo_target, capsys):
    shares = []
    for target in ("builtin:tiny", str(demo_target)):
        assert main(["data", "inspect", str(demo_data), "--target", target, "--json",
                     "--agreement-samples", "4", "--samples", "1"]) == 0
        report = json.loads(capsys.readouterr().out)
        a = report["agreement"]
        assert a["samples"] == 4 and a["positions"] > 0
        shares.append(a["share"])
    # The demo data's responses are this target's greedy continuations.
    assert shares[0] == shares[1] > 0.9


def test_inspect_without_a_target_reports_no_agreement(demo_data, capsys):
    assert main(["data", "inspect", str(demo_data), "--samples", "1"]) == 0
    out = capsys.readouterr().out
    assert "trained" in out and "agreement" not in out


def test_inspect_of_a_conversations_folder_says_to_prepare_it_first(tmp_path, capsys):
    from tests.core.data.test_output_folder import _rows, save_to_disk_folder

    ds = save_to_disk_folder(tmp_path / "ds", _rows())
    assert main(["data", "inspect", str(ds)]) == 2
    err = capsys.readouterr().err
    assert "holds conversations, not prepared (tokenized) data" in err
    assert "hint: prepare it first: dflash-tui data prepare" in err and "Traceback" not in err


def test_prepare_prints_each_reason_with_its_first_example(tmp_path, capsys):
    src = tmp_path / "c.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    src.write_bytes(json.dumps(good).encode() + b"\n\xff\xfe\n[1]\n")
    assert main(["data", "prepare", str(src), "--tokenizer", "builtin:tiny", "--out",
                 str(tmp_path / "o"), "--quiet", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "left out 1 rows: not_utf8 (e.g. row-1: the line is not UTF-8 text: line 2" in out
    assert "left out 1 rows: not_json (e.g. row-2: the line is not a JSON object: a JSON list" \
        in out


def test_what_no_check_foresaw_is_said_to_be_a_bug_exit_1(tmp_path, capsys, monkeypatch):
    import dflash_core.data.prepare as prep

    def bug(opts):
        raise ZeroDivisionError("oops")

    monkeypatch.setattr(prep, "prepare", bug)
    assert main(["data", "prepare", "x.jsonl", "--tokenizer", "builtin:tiny", "--out",
                 str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "ZeroDivisionError: oops" in err and "a bug in dflash" in err


def test_inspect_agreement_is_the_same_every_time_whatever_is_shown(tmp_path, demo_target,
                                                                   capsys):
    from dflash_core.demo.chat import write_demo_conversations

    src = write_demo_conversations(tmp_path / "c.jsonl", n=40)
    data = tmp_path / "data"
    assert main(["data", "prepare", str(src), "--tokenizer", "builtin:tiny", "--out", str(data),
                 "--quiet", "--workers", "1"]) == 0
    capsys.readouterr()
    reports = []
    for shown, seed in ((0, 0), (5, 0), (0, 0), (0, 3)):
        assert main(["data", "inspect", str(data), "--target", str(demo_target), "--json",
                     "--agreement-samples", "4", "--samples", str(shown),
                     "--seed", str(seed)]) == 0
        reports.append(json.loads(capsys.readouterr().out)["agreement"])
    # the samples shown do not move the samples measured; the seed does
    assert reports[0] == reports[1] == reports[2]
    assert reports[3]["indices"] != reports[0]["indices"] and reports[3]["seed"] == 3


def test_help_shows_the_defaults(capsys):
    import pytest

    for verb, shown in (("regenerate", ["--max-tokens MAX_TOKENS", "(default: 2048)",
                                        "(default: 1800.0)", "(default: 600.0)",
                                        "(default: chat)"]),
                        ("prepare", ["(default: 10000)", "(default: keep)"]),
                        ("inspect", ["(default: 16)"])):
        with pytest.raises(SystemExit) as e:
            main(["data", verb, "--help"])
        out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        assert e.value.code == 0 and all(s in out for s in shown), (verb, out)


def test_regenerated_as_text_is_said_by_prepare_and_named_by_inspects_low_agreement(
        tmp_path, demo_target, capsys):
    # issue 48 item 9: regenerate (a text-only server) -> prepare -> inspect, as a user runs
    # them; the low agreement names the text round trip, not "another model"
    from tests.core.data.regen.canned_server import CannedServer, convs, strict_fields

    regen, data = tmp_path / "regen", tmp_path / "data"
    with CannedServer(answer=strict_fields()) as srv:
        assert main(["data", "regenerate", str(convs(tmp_path, 4)), "--endpoint", srv.url,
                     "--out", str(regen), "--concurrency", "1", "--quiet"]) == 0
    assert main(["data", "prepare", str(regen), "--tokenizer", "builtin:tiny", "--out",
                 str(data), "--quiet", "--workers", "1"]) == 0
    said = (f"responses: 4 of 4 rows regenerated by 'canned' through {srv.url}, answers as "
            "text (prepare re-tokenized them)")
    assert said in capsys.readouterr().out
    assert main(["data", "inspect", str(data), "--target", str(demo_target), "--samples",
                 "0", "--agreement-samples", "4"]) == 0
    out = capsys.readouterr().out
    assert said in out
    # the canned answers are the question reversed: far from what the target writes, more
    # than a round trip changes
    (low,) = [x for x in out.splitlines() if x.strip().startswith("low (below 80%)")]
    assert "came back as text only" in low and "text round trip" in low
    assert "a round trip changes a few tokens per answer" in low and "other weights" in low
    assert "return_token_ids" in low and "written by another model" not in low
    assert "data inspect" not in low  # inspect does not point at itself
