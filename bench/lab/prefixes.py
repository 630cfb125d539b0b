"""File prefixes cut at a line end: the user turns of the conversations and the code set.

A prefix is a file's text from its first character to the end of a line that ends in a visible
character (its newline left out), about ``want`` tokens long. Cut there, the prompt's tokens are
the file's own: the byte-level pre-tokenizer never merges a newline with a visible character
before it, while a prompt ending in a newline (or in spaces) would end where the training text
had merged that whitespace with the next line's indentation (a token sequence the target never
saw). Its length in tokens is that of the text
tokenized alone, what a server and the evaluation see.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass
class Tokenized:
    """A document's text with its token end offsets (characters), tokenized once."""
    path: str
    text: str
    ends: list[int]  # character offset where each token ends
    breaks: list[int]  # character offsets of the newlines
    cuts: list[int]  # ... of those that follow a visible character: where a prefix may end

    @property
    def line_starts(self) -> list[int]:
        """Offsets of the lines after the first."""
        return [b + 1 for b in self.breaks]

    @property
    def tokens(self) -> int:
        return len(self.ends)


def tokenize_documents(tk, documents) -> list[Tokenized]:
    out = []
    texts = [d.text for d in documents]
    for at in range(0, len(texts), 512):
        for d, enc in zip(documents[at:at + 512],
                          tk.encode_batch(texts[at:at + 512], add_special_tokens=False)):
            text = d.text
            breaks = [i for i, c in enumerate(text) if c == "\n"]
            cuts = [b for b in breaks if b > 0 and not text[b - 1].isspace()]
            out.append(Tokenized(d.path, text, [e for _, e in enc.offsets], breaks, cuts))
    return out


def cut_at(doc: Tokenized, want: int) -> int | None:
    """The character offset of the last clean cut (``Tokenized.cuts``) at or before the end of
    token ``want`` (None when there is none that early)."""
    if want <= 0 or not doc.ends:
        return None
    end = doc.ends[min(want, doc.tokens) - 1]
    k = bisect.bisect_right(doc.cuts, end) - 1
    return doc.cuts[k] if k >= 0 else None


def token_count(tk, text: str) -> int:
    return len(tk.encode(text, add_special_tokens=False).ids)


def draw_prefixes(tk, docs: list[Tokenized], n: int, lo: int, hi: int, room: int,
                  rng: np.random.Generator, *, attempts: int = 20) -> list[tuple[Tokenized, str]]:
    """Up to ``n`` distinct (document, prefix) pairs with lo <= prefix tokens < hi, each document
    leaving ``room`` tokens after the prefix; documents drawn uniformly, cut lengths uniform."""
    fit = [d for d in docs if d.tokens >= lo + room]
    out: list[tuple[Tokenized, str]] = []
    seen: set[tuple[str, int]] = set()
    for _ in range(n * attempts):
        if len(out) == n or not fit:
            break
        d = fit[int(rng.integers(len(fit)))]
        top = min(hi, d.tokens - room)
        if top <= lo:
            continue
        cut = cut_at(d, int(rng.integers(lo, top)))
        if cut is None or (d.path, cut) in seen:
            continue
        prefix = d.text[:cut]
        if lo <= token_count(tk, prefix) < hi:
            seen.add((d.path, cut))
            out.append((d, prefix))
    return out
