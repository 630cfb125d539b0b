"""Rendering conversations: loss mask from token ids, multi-turn, the thinking policy, templates
that are missing or broken, the server's own ids."""

from __future__ import annotations

import pytest

from dflash_core.data.chat_render import (
    ChatRenderer, RenderStats, TemplateError, fingerprints, load_tokenizer,
)
from dflash_core.data.conversations import Conversation, RowError, normalise

from tests.core.data.chat_fixtures import train_bpe


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def tok(bpe_folder):
    return load_tokenizer(bpe_folder)


def trained_texts(tok, r) -> list[str]:
    """The decoded text of each run of trained positions."""
    spans, cur = [], []
    for t, m in zip(r.input_ids, r.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return [tok.decode(s) for s in spans]


def conv(*turns, **kw) -> Conversation:
    return normalise({"messages": [dict(role=r, content=c, **e) for r, c, *x in turns
                                   for e in [x[0] if x else {}]], **kw}, 0)


def test_mask_covers_exactly_the_assistant_turns(tok):
    c = conv(("system", "Be brief."), ("user", "What is two plus two?"),
             ("assistant", "Two plus two is four."), ("user", "And the fox?"),
             ("assistant", "The quick brown fox jumps."))
    [r] = ChatRenderer(tok).render(c)
    assert len(r.input_ids) == len(r.loss_mask)
    assert trained_texts(tok, r) == ["Two plus two is four.<|im_end|>\n",
                                     "The quick brown fox jumps.<|im_end|>\n"]
    # the whole sample is exactly the template's rendering
    assert tok.decode(r.input_ids) == tok.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in c.messages], tokenize=False)


def test_thinking_policies(tok):
    c = conv(("user", "What is two plus two?"),
             ("assistant", "<think>Let me think.</think>Four."),
             ("user", "Tell me about Paris."),
             ("assistant", "It rains.", {"reasoning_content": "The weather in Paris."}))
    assert c.messages[1] == {"role": "assistant", "content": "Four.",
                             "reasoning_content": "Let me think."}
    # keep: the template drops turn 1's reasoning from history, so each turn is its own sample
    st = RenderStats()
    a, b = ChatRenderer(tok, "keep").render(c, st)
    assert st.split_rows == 1
    assert trained_texts(tok, a) == ["<think>\nLet me think.\n</think>\n\nFour.<|im_end|>\n"]
    # ... the second as the target saw it: turn 1 without its reasoning, only turn 2 trained
    assert trained_texts(tok, b) == [
        "<think>\nThe weather in Paris.\n</think>\n\nIt rains.<|im_end|>\n"]
    assert "Let me think" not in tok.decode(b.input_ids)
    # last: one sample, reasoning on the last turn only
    st = RenderStats()
    [r] = ChatRenderer(tok, "last").render(c, st)
    assert st.split_rows == 0
    assert trained_texts(tok, r) == [
        "Four.<|im_end|>\n", "<think>\nThe weather in Paris.\n</think>\n\nIt rains.<|im_end|>\n"]
    # drop: no reasoning anywhere
    [r] = ChatRenderer(tok, "drop").render(c)
    assert "<think>" not in tok.decode(r.input_ids)
    assert trained_texts(tok, r) == ["Four.<|im_end|>\n", "It rains.<|im_end|>\n"]


def test_reasoning_inlined_for_a_template_that_does_not_read_it(tmp_path):
    plain = ("{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
             "'<|im_end|>\\n' -}}{%- endfor -%}"
             "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    tok = load_tokenizer(train_bpe(tmp_path / "t", template=plain))
    c = conv(("user", "Hello!"), ("assistant", "Four.", {"reasoning_content": "Think."}))
    [r] = ChatRenderer(tok, "keep").render(c)
    assert trained_texts(tok, r) == ["<think>\nThink.\n</think>\n\nFour.<|im_end|>\n"]


def test_server_ids_replace_a_retokenized_answer(tok):
    text = "Two plus two is four."
    own = tok(text, add_special_tokens=False)["input_ids"]
    # the same text as the server could have written it: other (finer) ids
    server = [i for ch in text for i in tok(ch, add_special_tokens=False)["input_ids"]]
    assert server != own
    end = tok.convert_tokens_to_ids("<|im_end|>")
    c = conv(("user", "What is two plus two?"),
             ("assistant", text, {"token_ids": server + [end]}))
    st = RenderStats()
    [r] = ChatRenderer(tok).render(c, st)
    trained = [t for t, m in zip(r.input_ids, r.loss_mask) if m]
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    assert trained == server + [end] + newline
    assert (st.server_ids_turns, st.server_ids_differ) == (1, 1)
    # ids equal to the re-tokenized text change nothing
    c2 = conv(("user", "What is two plus two?"), ("assistant", text, {"token_ids": own}))
    st2 = RenderStats()
    [r2] = ChatRenderer(tok).render(c2, st2)
    assert st2.server_ids_differ == 0 and sum(r2.loss_mask) == len(own) + 1 + len(newline)


def test_tokenizer_without_chat_template_is_refused(tmp_path):
    folder = train_bpe(tmp_path / "nochat", template=None)
    with pytest.raises(TemplateError, match="no chat template") as e:
        load_tokenizer(folder)
    assert "--chat-template" in e.value.hint


def test_a_tokenizer_folder_without_tokenizer_files_is_refused_even_with_a_template(tmp_path):
    # It prepared "32 samples, 64 tokens": transformers built an empty vocabulary from config.json.
    import json
    from dflash_core.data.shards import DataError
    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 100}))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(DataError, match="holds no tokenizer files") as e:
        load_tokenizer(folder, chat_template=template)
    assert "tokenizer.json" in e.value.hint


def test_template_that_fails_to_render_is_refused(tmp_path, bpe_folder):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")  # unclosed expression
    with pytest.raises(TemplateError, match="fails to render"):
        load_tokenizer(bpe_folder, chat_template=bad)


def test_a_row_the_template_rejects_is_a_counted_reason(tmp_path, bpe_folder):
    strict = tmp_path / "strict.jinja"
    strict.write_text("{%- for m in messages -%}{%- if m.role == 'system' -%}"
                      "{{ raise_exception('no system turns') }}{%- endif -%}"
                      "{{ m.content }}{%- endfor -%}")
    tok = load_tokenizer(bpe_folder, chat_template=strict)
    with pytest.raises(RowError, match="no system turns") as e:
        ChatRenderer(tok).render(conv(("system", "x"), ("user", "Hi"), ("assistant", "Hello")))
    assert e.value.reason == "template_error"


def test_fingerprints_tell_tokenizers_and_templates_apart(tmp_path, tok, bpe_folder):
    from dflash_core.data.byte_vocab import byte_tokenizer

    a = fingerprints(tok)
    assert a == fingerprints(load_tokenizer(bpe_folder))  # stable over loads
    b = fingerprints(byte_tokenizer())
    assert a["tokenizer"] != b["tokenizer"] and a["chat_template"] != b["chat_template"]


TOOL_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}"
    "<tool_call>{{ c.function.name }}({{ c.function.arguments }})</tool_call>"
    "{%- endfor -%}{%- endif -%}"
    "{%- if m.role == 'tool' %} [{{ m.tool_call_id }}]{% endif -%}<|im_end|>\n"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")


def test_tool_calls_are_rendered_trained_and_counted_not_dropped(tmp_path, bpe_folder):
    # Assistant tool_calls (and tool turns' ids) were dropped without a count while the template
    # renders them; an assistant turn holding only a call was refused as empty.
    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    tok = load_tokenizer(bpe_folder, chat_template=template)
    call = {"type": "function", "function": {"name": "fox", "arguments": "{}"}}
    c = normalise({"messages": [
        {"role": "user", "content": "Where is the fox?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "brown", "tool_call_id": "call-1"},
        {"role": "assistant", "content": "The fox is brown."}]}, 0)
    stats = RenderStats()
    [r] = ChatRenderer(tok).render(c, stats)
    texts = trained_texts(tok, r)
    assert len(texts) == 2 and texts[0].strip() == "<tool_call>fox({})</tool_call><|im_end|>"
    assert texts[1].strip() == "The fox is brown.<|im_end|>"
    assert "brown [call-1]" in tok.decode(r.input_ids)  # the tool turn, as context
    assert (stats.tool_call_turns, stats.tool_turns) == (1, 1)
    with pytest.raises(RowError, match="tool_calls is not a list of objects"):
        normalise({"messages": [{"role": "user", "content": "x"},
                                {"role": "assistant", "content": "", "tool_calls": "fox()"}]}, 0)
