"""The lab target's tokenizer: a byte-level BPE learned by the ``tokenizers`` library on the
corpus's training files, saved as an ordinary fast tokenizer with a chat template.

Ids: ``<|endoftext|>`` is 0 (ends a file in the training text and an assistant turn; also the pad
id), the learned merges follow, ``<|MASK|>`` is the last id (the drafter's mask token, never in
text: ``drafter.mask_token_id: -1`` resolves to it).

The chat template is the demo byte vocabulary's (``dflash_core.data.byte_vocab.CHAT_TEMPLATE``):
the turns back to back, each assistant turn closed by ``<|endoftext|>``. The target is a base
model of code, never trained on chat markers, so a rendered prompt is exactly the file prefix the
user turn holds and the answer is the code that follows it: code completion, the setting the
conversations and the eval sets measure.
"""

from __future__ import annotations

from pathlib import Path

from dflash_core.data.byte_vocab import CHAT_TEMPLATE

EOS = "<|endoftext|>"
MASK = "<|MASK|>"


def _training_texts(documents, max_bytes: int) -> list[str]:
    """The training files in the order of their path hash (every package represented, not the
    alphabet's first ones), up to ``max_bytes`` of text."""
    out, total = [], 0
    for d in sorted(documents, key=lambda d: (d.split_hash, d.path)):
        if total >= max_bytes:
            break
        out.append(d.text)
        total += len(d.text.encode("utf-8"))
    return out


def train_tokenizer(documents, vocab_size: int, max_bytes: int):
    """A ``tokenizers.Tokenizer``: byte-level BPE with ``vocab_size`` ids in all (the last one
    ``<|MASK|>``). Deterministic for the same documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(_training_texts(documents, max_bytes), trainer)
    tk.add_special_tokens([MASK])  # after the merges: the last id
    return tk


def fast_tokenizer(tk):
    """The transformers tokenizer around ``tk``, with the chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS, pad_token=EOS,
                                  mask_token=MASK)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tokenizer(tok, folder: Path) -> None:
    from dflash_core.demo.torch_env import quiet_hf

    with quiet_hf():
        tok.save_pretrained(str(folder))


def encode_documents(tk, documents, eos_id: int):
    """Every document's ids, ``eos_id`` after each, as one int32 array (the training stream)."""
    import numpy as np

    texts = [d.text for d in documents]
    parts = []
    for at in range(0, len(texts), 512):  # an Encoding holds strings and offsets: a few at a time
        for enc in tk.encode_batch(texts[at:at + 512], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.int32))
            parts.append(np.asarray([eos_id], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
