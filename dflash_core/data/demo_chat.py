"""The demo's conversations: a real fast tokenizer over the demo target's byte vocabulary, a chat
template of our own, and conversations cut from the held-out help text.

The demo target (``dflash_core.demo``) is a plain byte-level LM that never saw chat markers, so its
template puts the turns back to back and closes each assistant turn with ``<|endoftext|>`` (which
the target learned as the end of a help topic): a user turn is a piece of text, the assistant's
answer its continuation. Through this tokenizer the demo's data takes the same prepare ->
regenerate -> inspect path as a real target's.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from dflash_core.demo import EOS_ID, MASK_ID, SPECIAL_TOKENS, split_corpus

DEMO_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- m['content'] -}}"
    "{%- if m['role'] == 'assistant' -%}<|endoftext|>{%- endif -%}"
    "{%- endfor -%}"
)


def _byte_chars() -> list[str]:
    """A printable character per byte value (byte-level BPE's alphabet): printable Latin-1 bytes
    stand for themselves, the others are moved to code points from 256 up."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(_byte_chars())}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([SPECIAL_TOKENS[EOS_ID], SPECIAL_TOKENS[MASK_ID]])
    return tk.to_str()


def demo_tokenizer():
    """A ``PreTrainedTokenizerFast``: ids 0..255 = the bytes of UTF-8 text, 256 = <|endoftext|>,
    257 = <|MASK|>, exactly the demo target's vocabulary; the demo chat template set."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
                                  eos_token=SPECIAL_TOKENS[EOS_ID],
                                  pad_token=SPECIAL_TOKENS[EOS_ID])
    tok.chat_template = DEMO_TEMPLATE
    return tok


def _heldout_texts() -> list[str]:
    _, heldout = split_corpus()
    cuts = np.flatnonzero(heldout == EOS_ID)
    pieces = np.split(heldout, cuts)
    return [bytes(p[p != EOS_ID].astype(np.uint8)).decode("utf-8", "ignore") for p in pieces]


def demo_conversations(n: int = 256, prompt_chars: int = 64, answer_chars: int = 64,
                       seed: int = 0) -> list[dict]:
    """``n`` one-turn conversations in OpenAI ``messages`` form: a user turn of held-out help text
    and, as the assistant's answer, the text that follows it there (written by people, not by the
    target: ``regenerate`` replaces it)."""
    texts = [t for t in _heldout_texts() if len(t) > prompt_chars + answer_chars]
    rng = np.random.default_rng([seed, 3])
    rows = []
    for k in range(n):
        t = texts[int(rng.integers(len(texts)))]
        s = int(rng.integers(0, len(t) - prompt_chars - answer_chars))
        rows.append({"id": f"demo-{k}", "messages": [
            {"role": "user", "content": t[s:s + prompt_chars]},
            {"role": "assistant", "content": t[s + prompt_chars:s + prompt_chars + answer_chars]},
        ]})
    return rows


def write_demo_conversations(path: str | Path, n: int = 256, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in demo_conversations(n, seed=seed):
            fh.write(json.dumps(row) + "\n")
    return path
