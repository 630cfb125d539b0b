"""The target as speculative decoding drives it: tokens fed, the target's logits at each, then cut
back to what was accepted; the features of the kept tokens for the drafter.

A round feeds each prompt's last accepted token and its drafts, reads the target's logits after
each, and keeps only the accepted part. One prompt's state is a ``Decoding``:

- ``FullDecoding``: no cache; every feed is one forward over all kept tokens and the new ones
  (O(n^2) in the generated length; works with any ``TargetFn``).
- ``CachedDecoding``: the target's own cache; a feed runs only the new tokens. Attention layers'
  keys and values are cut back (``crop``). Recurrent layers (Gated DeltaNet's recurrent and conv
  states) cannot be cut back: before each feed a copy of the cache is kept, and a rewind takes
  the copy and feeds the accepted tokens again (one more forward of a few tokens). The choices are
  then the ones a server with a cache computes; in float32 they equal the full forward's.

A batch of prompts (what ``spec_decode.decode_rows`` drives: ``start``, ``verify``, ``context``,
``keep``) is either ``Rows``, a ``Decoding`` per prompt run one after another (``CachedRows``:
the cache per prompt, ``--cache`` / eval.cache; a one-prompt TargetFn's full forwards), or
``FullBatch``: ONE forward per round over every prompt, each its kept tokens plus its newly fed
ones, right-padded with an attention mask (the valid positions get what the prompt alone gets).
``FullBatch`` takes the logits only at the fed positions: the target's post-norm last hidden
state there times its lm_head, which is what the model's own head computes for the targets this
engine serves; ``head_is_lm_head`` checks that on the loaded target first, and a target whose
head does more (a soft cap, a scale) gets its whole logits instead.

A target whose layers run in a target group (target_group/remote.GroupTarget) brings its own
backends, the same rules with the forwards in its ranks: ``rows_backend``, ``ModelTarget`` and
``head_is_lm_head`` ask it for them.
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
        """Append ``new``; the target's logits [n, V] after each of them, or after the last
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
        return logits[0, -(last or len(new)):]

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
        return logits[0]

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


# --------------------------------------------------------------------------------------------
# A batch of prompts
# --------------------------------------------------------------------------------------------

def _pad(seqs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    T = max(map(len, seqs))
    ids = torch.zeros((len(seqs), T), dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    full = bool(mask.all())
    return ids.to(device), (None if full else mask.to(device))


@torch.no_grad()
def head_is_lm_head(target, probe: list[int], layer_ids: list[int]) -> bool:
    """Whether the model's logits are its lm_head of the post-norm last hidden state (no soft
    cap, no scale after it), on one probe sequence."""
    own = getattr(target, "head_is_lm_head", None)  # a target group's: asked of its ranks
    if own is not None:
        return own(probe, layer_ids)
    ids = torch.tensor([probe], dtype=torch.long, device=target.device)
    logits, _ = target.logits_and_features(ids, layer_ids)
    feats = target.features(ids, layer_ids=layer_ids, with_last_hidden=True)
    h = feats[..., -target.hidden_size:]
    ours = target.lm_head(h.to(target.lm_head.weight.dtype)).float()
    tol = 1e-4 if target.dtype == torch.float32 else 2e-2
    return bool(torch.allclose(ours, logits.float(), rtol=tol, atol=tol * float(
        logits.float().abs().max().clamp_min(1.0))))


class FullBatch:
    """Rows decoded with one full forward per round for all of them (see the module)."""

    def __init__(self, target, layer_ids: list[int], exact_head: bool = True):
        self.target, self.layer_ids, self.exact_head = target, list(layer_ids), exact_head
        self.kH = len(self.layer_ids) * target.hidden_size
        self.tokens: dict[int, list[int]] = {}
        self._feats: torch.Tensor | None = None  # [m, T, k*H] of the last forward's rows
        self._rows: list[int] = []

    def start(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        self.tokens = {i: [] for i in range(len(prompts))}
        return [lg[-1] for lg in self.verify(list(range(len(prompts))), prompts)]

    def verify(self, rows: list[int], feeds: list[list[int]]) -> list[torch.Tensor]:
        """Append ``feeds[j]`` to row ``rows[j]``; the target's logits [len(feed), V] at each."""
        seqs = []
        for r, f in zip(rows, feeds):
            self.tokens[r].extend(f)
            seqs.append(self.tokens[r])
        ids, mask = _pad(seqs, self.target.device)
        lens = [len(s) for s in seqs]
        if self.exact_head:
            feats = self.target.features(ids, mask, self.layer_ids, with_last_hidden=True)
            ctx, h = feats[..., :self.kH], feats[..., self.kH:]
            F, T = max(map(len, feeds)), h.shape[1]
            # each row's fed positions (a shorter feed's slots past it read its last position)
            at = torch.tensor([[min(T - 1, L - len(f) + k) for k in range(F)]
                               for L, f in zip(lens, feeds)], device=h.device)
            sel = torch.gather(h, 1, at[..., None].expand(-1, -1, h.shape[-1]))
            logits = self.target.lm_head(sel.to(self.target.lm_head.weight.dtype))
            out = [logits[j, :len(f)] for j, f in enumerate(feeds)]
        else:
            full, ctx = self.target.logits_and_features(ids, self.layer_ids, mask)
            out = [full[j, L - len(f):L] for j, (L, f) in enumerate(zip(lens, feeds))]
        self._feats, self._rows = ctx, list(rows)
        return out

    def context(self, rows: list[int], lengths: list[int]) -> torch.Tensor:
        """[m, max(lengths), k*H]: the features of each row's first ``lengths`` tokens (the
        last forward computed them; positions past a row's length are never attended)."""
        S = max(lengths)
        if rows == self._rows:
            return self._feats[:, :S]
        idx = torch.tensor([self._rows.index(r) for r in rows], device=self._feats.device)
        return self._feats.index_select(0, idx)[:, :S]

    def keep(self, row: int, length: int) -> None:
        del self.tokens[row][length:]


class Rows:
    """Each row its own ``Decoding`` (made by ``decoding()``), run one after another through
    the target (their rewinds differ); their drafts still come in one drafter forward."""

    def __init__(self, decoding: Callable[[], Decoding]):
        self.decoding = decoding
        self.rows: dict[int, Decoding] = {}

    def start(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        out = []
        for i, p in enumerate(prompts):
            self.rows[i] = self.decoding()
            out.append(self.rows[i].feed(list(p), last=1)[-1])
        return out

    def verify(self, rows: list[int], feeds: list[list[int]]) -> list[torch.Tensor]:
        return [self.rows[r].feed(list(f)) for r, f in zip(rows, feeds)]

    def context(self, rows: list[int], lengths: list[int]) -> torch.Tensor:
        feats = [self.rows[r].features()[0, :S] for r, S in zip(rows, lengths)]
        S = max(lengths)
        out = feats[0].new_zeros((len(rows), S, feats[0].shape[-1]))
        for j, f in enumerate(feats):
            out[j, :f.shape[0]] = f
        return out

    def keep(self, row: int, length: int) -> None:
        self.rows[row].rewind(length)


class CachedRows(Rows):
    """Each row with the target's own cache (``CachedDecoding``)."""

    def __init__(self, target, layer_ids: list[int]):
        super().__init__(lambda: CachedDecoding(target, layer_ids))


def rows_backend(target, layer_ids: list[int], cache: bool, exact_head: bool = True):
    """The target's side of ``spec_decode.decode_rows``: the target's cache per row (``cache``:
    eval.cache, ``--cache``), else one full forward per round for all rows."""
    own = getattr(target, "rows_backend", None)  # a target group's (its forwards in its ranks)
    if own is not None:
        return own(layer_ids, cache, exact_head)
    return CachedRows(target, layer_ids) if cache else FullBatch(target, layer_ids, exact_head)


def fn_rows(target_fn: TargetFn, device="cpu") -> Rows:
    """Rows of a one-prompt TargetFn: its own state when it has one (``ModelTarget.decoding``:
    the cache), else its full forwards (``FullDecoding``)."""
    own = getattr(target_fn, "decoding", None)
    return Rows(lambda: (own() if own is not None else None) or FullDecoding(target_fn, device))


# --------------------------------------------------------------------------------------------
# One-prompt TargetFns
# --------------------------------------------------------------------------------------------

class ModelTarget:
    """A ``target.TargetModel`` as a TargetFn (its ``logits_and_features``); with ``cache``,
    decoding keeps the target's cache between rounds (``CachedDecoding``)."""

    def __init__(self, target_model, layer_ids: Sequence[int] | None, cache: bool = False):
        self.model, self.cache = target_model, cache
        self.layer_ids = list(layer_ids) if layer_ids is not None else None

    def __call__(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.logits_and_features(input_ids, self.layer_ids)

    def decoding(self) -> Decoding | None:
        """A new prompt's state with the cache; None: decoding's full forwards. A target group's
        own either way (its forwards return the fed positions' logits only)."""
        own = getattr(self.model, "decoding", None)
        if own is not None:
            return own(self.layer_ids, self.cache)
        return CachedDecoding(self.model, self.layer_ids) if self.cache else None


def target_fn_for(target_model, layer_ids: Sequence[int] | None, *,
                  cache: bool = False) -> ModelTarget:
    """Adapt a ``target.TargetModel`` to a TargetFn; ``cache``: decode with its cache."""
    return ModelTarget(target_model, layer_ids, cache)


def hf_target_fn(model, layer_ids: Sequence[int]) -> TargetFn:
    """A TargetFn straight from an HF causal LM (``hidden_states[i + 1]`` is layer i's output)."""
    ids = list(layer_ids)

    def fn(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        return out.logits, torch.cat([out.hidden_states[i + 1] for i in ids], dim=-1)

    return fn


def features_fn_for(target_model, layer_ids: Sequence[int] | None):
    """``target.TargetModel.features`` of ``layer_ids`` as ``fn(ids [1, T]) -> [1, T, k*H]``."""
    ids = list(layer_ids) if layer_ids is not None else None
    return lambda input_ids: target_model.features(input_ids, layer_ids=ids)
