"""A GPT-2-style byte-level BPE merges the generation prompt's last newline with an answer's
indentation ("\\n" + "   " -> "\\n   "): the loss mask is still found (the prompt and the answer
tokenized apart, their ids joined), and every row is counted once under a reason that is true."""

from __future__ import annotations

import json

import pytest

from dflash_core.data import ShardedDataset
from dflash_core.data.chat_render import ChatRenderer, RenderStats, load_tokenizer
from dflash_core.data.conversations import RowError, normalise
from dflash_core.data.prepare import PrepareOptions, prepare

from tests.core.data.chat_fixtures import CODE_CORPUS, QWEN_STYLE, train_bpe

CHATML = ("{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
          "'<|im_end|>\\n' -}}{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
ANSWER = "    if self.ok:\n        return 1"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(train_bpe(tmp_path_factory.mktemp("gpt2"), CHATML, CODE_CORPUS))


def conv(*turns):
    return normalise({"messages": [{"role": r, "content": c} for r, c in turns]}, 0)


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def trained(r):
    return [t for t, m in zip(r.input_ids, r.loss_mask) if m]


def test_the_tokenizer_merges_across_the_turn_boundary(tok):
    # what made the old rule fail: the prompt's ids are not a prefix of the turn's ids
    p = tok.apply_chat_template([{"role": "user", "content": "Go"}], tokenize=False,
                                add_generation_prompt=True)
    f = p + ANSWER + "<|im_end|>\n"
    assert encode(tok, f)[:len(encode(tok, p))] != encode(tok, p)


def test_prompt_and_answer_are_tokenized_apart_and_joined(tok):
    c = conv(("user", "Go"), ("assistant", ANSWER))
    st = RenderStats()
    [r] = ChatRenderer(tok).render(c, st)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Go"}], tokenize=False,
                                     add_generation_prompt=True)
    n = len(encode(tok, prompt))
    # the prompt's ids exactly as a server tokenizes it, then the answer as the target writes it
    assert r.input_ids[:n] == encode(tok, prompt) and r.loss_mask[:n] == [0] * n
    assert trained(r) == encode(tok, ANSWER + "<|im_end|>\n")
    assert tok.decode(trained(r)) == ANSWER + "<|im_end|>\n"
    assert tok.decode(r.input_ids) == prompt + ANSWER + "<|im_end|>\n"
    assert (st.joined_rows, st.split_rows) == (1, 0)


def test_multi_turn_with_merges_is_one_sample_with_every_answer_trained(tok):
    c = conv(("user", "Go"), ("assistant", ANSWER), ("user", "More"),
             ("assistant", "  return 2"))
    st = RenderStats()
    [r] = ChatRenderer(tok).render(c, st)
    spans, cur = [], []
    for t, m in zip(r.input_ids + [None], r.loss_mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    assert spans == [ANSWER + "<|im_end|>\n", "  return 2<|im_end|>\n"]
    assert (st.joined_rows, st.split_rows) == (1, 0)


def test_server_ids_replace_the_answer_of_a_joined_turn(tok):
    own = encode(tok, ANSWER)
    server = [i for ch in ANSWER for i in encode(tok, ch)]  # finer ids for the same text
    end = tok.convert_tokens_to_ids("<|im_end|>")
    row = {"messages": [{"role": "user", "content": "Go"},
                        {"role": "assistant", "content": ANSWER, "token_ids": server + [end]}]}
    st = RenderStats()
    [r] = ChatRenderer(tok).render(normalise(row, 0), st)
    assert server != own and trained(r) == server + [end] + encode(tok, "\n")
    assert (st.server_ids_turns, st.server_ids_differ, st.joined_rows) == (1, 1, 1)


def test_a_split_conversation_with_merges_still_renders(tmp_path):
    # Qwen-style: history drops earlier reasoning (split), and the BPE merges at the boundary
    tok = load_tokenizer(train_bpe(tmp_path / "q", QWEN_STYLE, CODE_CORPUS))
    row = {"messages": [{"role": "user", "content": "Go"},
                        {"role": "assistant", "content": ANSWER, "reasoning_content": "hmm"},
                        {"role": "user", "content": "More"},
                        {"role": "assistant", "content": "    pass"}]}
    st = RenderStats()
    a, b = ChatRenderer(tok, "keep").render(normalise(row, 0), st)
    assert tok.decode(trained(a)).endswith(ANSWER + "<|im_end|>\n")
    assert tok.decode(trained(b)) == "    pass<|im_end|>\n"
    assert (st.split_rows, st.joined_rows) == (1, 1)


def test_a_true_prefix_mismatch_is_counted_once_and_not_as_split(tmp_path):
    # the generation prompt says "assistant\n", a written turn "assistant:\n": no rendering of
    # the prompt starts the turn's, in tokens or in text
    odd = ("{%- for m in messages -%}{%- if m.role == 'assistant' -%}"
           "{{- '<|im_start|>assistant:\\n' + m.content + '<|im_end|>\\n' -}}{%- else -%}"
           "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
           "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
           "{%- endif -%}")
    tok = load_tokenizer(train_bpe(tmp_path / "odd", odd, CODE_CORPUS))
    st = RenderStats()
    with pytest.raises(RowError) as e:
        ChatRenderer(tok).render(conv(("user", "Go"), ("assistant", "x")), st)
    assert e.value.reason == "prefix_mismatch" and "turn 1" in str(e.value)
    assert (st.split_rows, st.joined_rows) == (0, 0)  # a row left out is no split row


def test_prepare_keeps_every_row_of_indented_answers(tmp_path):
    folder = train_bpe(tmp_path / "gpt2", CHATML, CODE_CORPUS)
    rows = [{"id": f"r{k}", "messages": [{"role": "user", "content": f"task {k}"},
                                         {"role": "assistant", "content": " " * (k % 6) +
                                          f"return {k}"}]} for k in range(24)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = prepare(PrepareOptions(src, tmp_path / "out", tokenizer=str(folder), workers=1,
                               progress=False))
    c = m["counts"]
    assert c["samples"] == 24 and c["dropped"] == {} and c["split_rows"] == 0
    tok = load_tokenizer(folder)

    def merges(row):  # the old rule's failure: the prompt's ids no prefix of the turn's
        p = tok.apply_chat_template(row["messages"][:1], tokenize=False,
                                    add_generation_prompt=True)
        f = tok.apply_chat_template(row["messages"], tokenize=False)
        return encode(tok, f)[:len(encode(tok, p))] != encode(tok, p)

    assert c["joined_rows"] == sum(map(merges, rows)) >= 4  # every answer of 4 spaces at least
    ds = ShardedDataset.open(tmp_path / "out")
    for k in (2, 5):
        ids, mask = ds.get(k)
        assert tok.decode([int(t) for t, m in zip(ids, mask) if m]) == (
            " " * (k % 6) + f"return {k}<|im_end|>\n")


def test_a_split_row_is_counted_once_whatever_happens_to_its_turns(tmp_path):
    tok_folder = train_bpe(tmp_path / "q", QWEN_STYLE)

    def row(rid, second):
        return {"id": rid, "messages": [
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi.", "reasoning_content": "Greet."},
            {"role": "user", "content": "The weather?"},
            {"role": "assistant", "content": second}]}

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in (
        row("short", "It rains."), row("long", "It rains. " * 40),
        {"id": "huge", "messages": [
            {"role": "user", "content": "Hello! " * 30},
            {"role": "assistant", "content": "Hi.", "reasoning_content": "Greet."},
            {"role": "user", "content": "x"}, {"role": "assistant", "content": "y " * 40}]})))
    m = prepare(PrepareOptions(src, tmp_path / "out", tokenizer=str(tok_folder),
                               max_length=60, workers=1, progress=False))
    c = m["counts"]
    # short: 2 samples; long: both turns, its second cut inside the answer; huge: no answer in
    # the first 60 tokens of either turn
    assert c["samples"] == 4 and c["rows_used"] == 2
    assert c["dropped"] == {"too_long": 1}  # the row, once (not once per turn)
    assert c["split_rows"] == 2 and c["split_samples_dropped"] == {}
    assert c["cut"]["samples"] == c["cut"]["in_answer"] == 1
