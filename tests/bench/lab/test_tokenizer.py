"""bench/lab/tokenizer.py and prefixes.py: the BPE learned on the corpus, prompts cut from it."""

import numpy as np

from bench.lab.corpus import collect
from bench.lab.prefixes import cut_at, draw_prefixes, token_count, tokenize_documents
from bench.lab.tokenizer import EOS, MASK, encode_documents, fast_tokenizer, train_tokenizer


def _docs():
    return collect(("labfake_pkg", "labfake_single"), heldout_per_mille=0, chat_per_mille=0,
                   max_file_bytes=100_000).documents


def test_the_tokenizer_is_learned_deterministically_with_eos_first_and_mask_last(fake_site):
    docs = _docs()
    tk = train_tokenizer(docs, 400, 1_000_000)
    assert tk.to_str() == train_tokenizer(docs, 400, 1_000_000).to_str()
    assert tk.token_to_id(EOS) == 0
    assert tk.token_to_id(MASK) == tk.get_vocab_size() - 1
    assert tk.get_vocab_size() <= 400
    text = docs[3].text
    ids = tk.encode(text).ids
    assert len(ids) < len(text) / 2  # merges learned: fewer tokens than characters
    assert tk.decode(ids) == text
    stream = encode_documents(tk, docs[:2], tk.token_to_id(EOS))
    assert stream.dtype == np.int32 and list(stream).count(0) == 2 and stream[-1] == 0


def test_the_chat_template_puts_the_turns_back_to_back_and_ends_an_answer_with_eos(fake_site):
    tok = fast_tokenizer(train_tokenizer(_docs(), 400, 1_000_000))
    msgs = [{"role": "user", "content": "def f(x):"},
            {"role": "assistant", "content": "\n    return x"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "def f(x):\n    return x" + EOS
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "def f(x):"  # the rendered prompt is the file prefix itself


def test_a_prefix_ends_at_a_line_end_and_its_tokens_are_the_files_own(fake_site):
    docs = _docs()
    tk = train_tokenizer(docs, 400, 1_000_000)
    tdocs = tokenize_documents(tk, docs)
    doc = next(d for d in tdocs if d.path.endswith("mod4.py"))
    cut = cut_at(doc, 30)
    assert doc.text[cut] == "\n" and doc.ends[29] >= cut
    assert cut_at(doc, 0) is None
    pairs = draw_prefixes(tk, tdocs, 12, 20, 60, 8, np.random.default_rng(1))
    assert len(pairs) == 12 and len({p for _, p in pairs}) == 12
    again = draw_prefixes(tk, tdocs, 12, 20, 60, 8, np.random.default_rng(1))
    assert [p for _, p in again] == [p for _, p in pairs]
    for d, prefix in pairs:
        assert d.text.startswith(prefix) and d.text[len(prefix)] == "\n"
        n = token_count(tk, prefix)
        assert 20 <= n < 60
        # cut at a line end, the prompt's tokens are the start of the file's tokens
        assert tk.encode(prefix).ids == tk.encode(d.text).ids[:n]
