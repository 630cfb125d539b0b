"""Long conversations (issue 47, item 4): ``data prepare --max-length L`` keeps each one whole up
to L tokens (its first L, the cut a run makes at data.max_length) instead of leaving it out, and
says how many were cut, where, and what was lost; ``data inspect`` shows the lengths of the
prompts and the answers."""

from __future__ import annotations

import json

import numpy as np

from dflash_core.data import ShardedDataset
from dflash_core.data.inspect import format_report, inspect, turn_lengths
from dflash_core.data.prepare import PrepareOptions, prepare
from dflash_tui.cli import main

L = 40  # the byte tokenizer: one token a character, the answer's end one more
ROWS = [
    {"id": "short", "messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "yo"}]},
    {"id": "long-answer", "messages": [{"role": "user", "content": "q" * 10},
                                       {"role": "assistant", "content": "a" * 50}]},
    {"id": "long-second-prompt", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "u" * 60}, {"role": "assistant", "content": "b" * 5}]},
    {"id": "long-first-prompt", "messages": [{"role": "user", "content": "x" * 50},
                                             {"role": "assistant", "content": "z"}]},
]


def _source(tmp_path):
    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return src


def _samples(folder):
    ds = ShardedDataset.open(folder)
    return [tuple(np.asarray(a) for a in ds.get(i)) for i in range(len(ds))]


def test_a_long_conversation_is_kept_whole_up_to_max_length_and_its_cut_said(tmp_path):
    src = _source(tmp_path)
    prepare(PrepareOptions(src, tmp_path / "whole", workers=1, progress=False))
    whole = _samples(tmp_path / "whole")
    m = prepare(PrepareOptions(src, tmp_path / "cut", max_length=L, workers=1, progress=False))
    kept = _samples(tmp_path / "cut")
    # every sample is the unlimited one's first L tokens; the one with no answer there is out
    assert len(whole) == 4 and len(kept) == 3
    for (ids, mask), (w_ids, w_mask) in zip(kept, whole[:3]):
        assert np.array_equal(ids, w_ids[:L]) and np.array_equal(mask, w_mask[:L])
    c = m["counts"]
    assert c["dropped"] == {"too_long": 1} and c["rows_used"] == 3
    assert m["examples"]["too_long"] == (
        f"long-first-prompt: {len(whole[3][0])} tokens > {L}, and the first {L} hold no answer "
        f"(the first starts at token {int(np.flatnonzero(whole[3][1])[0])})")
    lost = [len(w) - L for w, _ in whole[1:3]]
    trained_lost = [int(w[L:].sum()) for _, w in whole[1:3]]
    tokens, trained = sum(len(i) for i, _ in kept), sum(int(k.sum()) for _, k in kept)
    assert c["cut"] == {
        "max_length": L, "samples": 2, "in_answer": 1, "in_prompt": 1,
        "tokens_lost": sum(lost), "trained_tokens_lost": sum(trained_lost),
        "tokens_lost_share": round(sum(lost) / (tokens + sum(lost)), 4),
        "trained_lost_share": round(sum(trained_lost) / (trained + sum(trained_lost)), 4),
        "longest": max(len(w) for w, _ in whole[1:3])}
    assert m["tokens"]["tokens"] == tokens and m["tokens"]["length"]["max"] == L
    assert prepare(PrepareOptions(src, tmp_path / "cut", workers=1, progress=False,
                                  overwrite=True))["counts"]["cut"]["samples"] == 0


def test_prepare_and_inspect_say_the_cuts_and_the_lengths(tmp_path, capsys):
    src = _source(tmp_path)
    assert main(["data", "prepare", str(src), "--tokenizer", "builtin:tiny", "--out",
                 str(tmp_path / "d"), "--max-length", str(L), "--workers", "1",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert (f"cut 2 samples to their first {L} tokens (the longest had 71): 1 inside an "
            "answer, 1 in a prompt; 52 tokens lost") in out
    assert "left out 1 rows: too_long (e.g. long-first-prompt: 52 tokens" in out
    r = inspect(tmp_path / "d", samples=0)
    # prompts: each answer's context since the answer before; answers: the trained runs (the
    # prompt the cut left without its answer is context of nothing)
    assert r["prompts"]["count"] == 3 and r["answers"]["count"] == 3
    assert r["prompts"]["max"] == 10 and r["answers"]["max"] == L - 10
    assert r["prompts"]["p50"] == 2 and r["answers"]["p50"] == 3
    text = format_report(r)
    assert f"cut 2 samples to their first {L} tokens" in text
    assert "prompts (3)" in text and "answers (3)" in text
    assert "prompt lengths:" in text and "answer lengths:" in text


def test_turn_lengths_split_a_sample_at_its_answers():
    mask = np.array([0, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0])  # a tail after the last answer
    assert turn_lengths(mask) == ([3, 1], [2, 3])
    assert turn_lengths(np.array([1, 1, 0])) == ([0], [2])  # an answer from the first token
    assert turn_lengths(np.zeros(4, np.int8)) == ([], [])
