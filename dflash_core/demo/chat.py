"""The demo's conversations, cut from the held-out help text the demo target never trained on.

Rendered through the built-in byte tokenizer (``dflash_core.data.byte_vocab``), whose template
puts the turns back to back and closes each assistant turn with ``<|endoftext|>`` (which the demo
target learned as the end of a help topic): a user turn is a piece of text, the assistant's answer
its continuation. So the demo's data takes the same prepare -> regenerate -> inspect path as a
real target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash_core.data.byte_vocab import EOS_ID
from dflash_core.demo.corpus import split_corpus


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
