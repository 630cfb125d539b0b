"""The target as speculative decoding drives it: tokens fed, then cut back to what was accepted.

A round feeds the last accepted token and the drafted ones, learns the target's choice after each,
and keeps only the accepted part. Two ways to keep the target's state:

- ``FullDecoding``: no cache; every feed is one forward over all kept tokens and the new ones
  (O(n^2) in the generated length; works with any ``TargetFn``).
- ``CachedDecoding``: the target's own cache; a feed runs only the new tokens. Attention layers'
  keys and values are cut back (``crop``). Recurrent layers (Gated DeltaNet's recurrent and conv
  states) cannot be cut back: before each feed a copy of the cache is kept, and a rewind takes
  the copy and feeds the accepted tokens again (one more forward of a few tokens). The choices are
  then the ones a server with a cache computes; in float32 they equal the full forward's.
"""

from __future__ import annotations

import copy
from typing import Callable, Protocol, Sequence

import torch

# target_fn(input_ids [1, T]) -> (logits [1, T, V], features [1, T, k*H]) of one full forward.
TargetFn = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


class Decoding(Protocol):
    """One prompt's target state during decoding."""

    def feed(self, new: list[int], last: int = 0) -> torch.Tensor:
        """Append ``new``; the target's choice (argmax) after each of them, or after the last
        ``last`` of them."""

    def features(self) -> torch.Tensor:
        """[1, kept, k*H]: the features of every kept token."""

    def rewind(self, length: int) -> None:
        """Keep the first ``length`` tokens; ``length`` is at least what was kept before the last
        feed (a round drops only what it added)."""


class FullDecoding:
    """Without a cache: a feed is one forward over every kept token and the new ones."""

    def __init__(self, target_fn: TargetFn, device="cpu"):
        self.target_fn, self.device = target_fn, device
        self.tokens: list[int] = []
        self._feats: torch.Tensor | None = None

    def feed(self, new: list[int], last: int = 0) -> torch.Tensor:
        self.tokens.extend(new)
        logits, self._feats = self.target_fn(
            torch.tensor([self.tokens], dtype=torch.long, device=self.device))
        return logits[0, -(last or len(new)):].argmax(-1)

    def features(self) -> torch.Tensor:
        return self._feats[:, :len(self.tokens)]

    def rewind(self, length: int) -> None:
        del self.tokens[length:]


def attention_only(text_config) -> bool:
    """Whether every layer is full attention (a cache that ``crop`` cuts back exactly)."""
    kinds = getattr(text_config, "layer_types", None)
    return bool(kinds) and all(k == "full_attention" for k in kinds)


class CachedDecoding:
    """With the target's cache (``TargetModel.decode_step``); see the module's docstring."""

    def __init__(self, target_model, layer_ids: Sequence[int] | None):
        self.target = target_model
        self.layer_ids = list(layer_ids) if layer_ids is not None else None
        self.croppable = attention_only(target_model.text_config)
        self.tokens: list[int] = []
        self._cache = None
        self._chunks: list[torch.Tensor] = []  # features, one tensor per feed
        self._saved: tuple[object, int] | None = None  # (cache copy, tokens) before the last feed

    def feed(self, new: list[int], last: int = 0, *, keep_copy: bool = True) -> torch.Tensor:
        if keep_copy and not self.croppable and self._cache is not None:
            self._saved = (copy.deepcopy(self._cache), len(self.tokens))
        ids = torch.tensor([new], dtype=torch.long, device=self.target.device)
        logits, feats, self._cache = self.target.decode_step(ids, self.layer_ids, self._cache,
                                                              logits_to_keep=last)
        self.tokens.extend(new)
        self._chunks.append(feats)
        return logits[0].argmax(-1)

    def features(self) -> torch.Tensor:
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks, dim=1)]
        return self._chunks[0]

    def rewind(self, length: int) -> None:
        drop = len(self.tokens) - length
        if drop <= 0:
            return
        feats = self.features()
        if self.croppable:
            self._cache.crop(-drop)  # negative: remove that many (every transformers 5 accepts it)
            del self.tokens[length:]
            self._chunks = [feats[:, :length]]
            return
        if self._saved is None or self._saved[1] > length:
            raise RuntimeError(f"cannot rewind to {length} tokens: the cache copy holds "
                               f"{self._saved[1] if self._saved else 'none'}")
        self._cache, kept = self._saved
        self._saved = None
        again = self.tokens[kept:length]
        del self.tokens[kept:]
        self._chunks = [feats[:, :kept]]
        if again:
            self.feed(again, keep_copy=False)
