"""The built-in byte vocabulary (``builtin:tiny``'s): ids, text <-> ids, and a fast tokenizer.

``VOCAB_SIZE`` = 258: ids 0..255 are the bytes of UTF-8 text; 256 is ``<|endoftext|>``
(``EOS_ID``: ends a document or an assistant turn, also the pad id); 257 is ``<|MASK|>``
(``MASK_ID``: the drafter's mask token; never in the text, and the last id, so
``drafter.mask_token_id: -1`` resolves to it too).

The tokenizer is a real ``PreTrainedTokenizerFast`` over exactly these ids, with a chat template
of its own: a byte-level LM never saw chat markers, so the turns go back to back and each
assistant turn ends with ``<|endoftext|>``. Through it the demo's data takes the same prepare ->
regenerate -> inspect path as a real target's; the demo itself (``dflash_core.demo``) builds on
this module, never the other way round.
"""

from __future__ import annotations

import functools

EOS_ID = 256
MASK_ID = 257
VOCAB_SIZE = 258
SPECIAL_TOKENS = {EOS_ID: "<|endoftext|>", MASK_ID: "<|MASK|>"}

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- m['content'] -}}"
    "{%- if m['role'] == 'assistant' -%}<|endoftext|>{%- endif -%}"
    "{%- endfor -%}"
)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    """Byte ids back to text; special ids shown by name, invalid UTF-8 replaced."""
    out, buf = [], bytearray()
    for i in (int(t) for t in ids):
        if i < 256:
            buf.append(i)
            continue
        out.append(buf.decode("utf-8", "replace"))
        buf = bytearray()
        out.append(SPECIAL_TOKENS.get(i, f"<|{i}|>"))
    out.append(buf.decode("utf-8", "replace"))
    return "".join(out)


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


def byte_tokenizer(mask_token: bool = False):
    """A ``PreTrainedTokenizerFast``: ids 0..255 = the bytes of UTF-8 text, 256 = <|endoftext|>,
    257 = <|MASK|>; ``CHAT_TEMPLATE`` set. ``mask_token``: <|MASK|> named the mask token too (what
    a saved folder says of it; the ids are the same either way)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    named = {"mask_token": SPECIAL_TOKENS[MASK_ID]} if mask_token else {}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
                                  eos_token=SPECIAL_TOKENS[EOS_ID],
                                  pad_token=SPECIAL_TOKENS[EOS_ID], **named)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_byte_tokenizer(folder) -> None:
    """Save the byte tokenizer (its end and mask tokens, the chat template) into a model folder,
    so that ``AutoTokenizer.from_pretrained(folder)`` loads it offline and a server takes text."""
    byte_tokenizer(mask_token=True).save_pretrained(str(folder))
