"""The demo's text: Python's own help topics as byte ids, and the held-out part never trained on."""

from __future__ import annotations

import hashlib

import numpy as np

from dflash_core.data.byte_vocab import EOS_ID
from dflash_core.demo.recipe import HELDOUT_FRACTION


def corpus_ids() -> np.ndarray:
    """The corpus as token ids (int64): bytes, and EOS_ID between topics."""
    from pydoc_data.topics import topics

    out: list[np.ndarray] = []
    for k in sorted(topics):
        out.append(np.frombuffer(topics[k].encode("utf-8"), dtype=np.uint8).astype(np.int64))
        out.append(np.array([EOS_ID], dtype=np.int64))
    return np.concatenate(out)


def corpus_digest() -> str:
    """Fingerprint of the corpus: another Python version ships other help text."""
    return hashlib.sha256(corpus_ids().tobytes()).hexdigest()[:12]


def split_corpus(ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout): the last HELDOUT_FRACTION of the corpus is never trained on."""
    ids = corpus_ids() if ids is None else ids
    cut = int(len(ids) * (1 - HELDOUT_FRACTION))
    return ids[:cut], ids[cut:]
