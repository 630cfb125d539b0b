"""The target's side of decoding several prompts at once: feed tokens, read the target's logits at
the fed positions, keep only what was accepted, and hand the drafter the kept tokens' features.

Two ways, as ``models/target_decoding.py`` has for one prompt:

- ``FullBatch`` (the default): no cache. A round is ONE forward over every prompt of the batch,
  each its kept tokens plus its newly fed ones, right-padded with an attention mask (the valid
  positions get what the prompt alone gets). The logits are taken only at the fed positions:
  the target's post-norm last hidden state there times its lm_head, which is what the model's
  own head computes for the targets this engine serves; ``head_is_lm_head`` checks that on the
  loaded target first, and a target whose head does more (a soft cap, a scale) gets its whole
  logits instead.
- ``CachedRows`` (``--cache``, ``eval.cache``'s path): each prompt keeps the target's own cache
  in a ``CachedDecoding``, cut back after each round; a hybrid target's recurrent state is
  restored from its copy and fed the accepted tokens again. The prompts run one after another
  through the target (their rewinds differ), their drafts still in one drafter forward.
"""

from __future__ import annotations

import torch

from dflash_core.models.target_decoding import CachedDecoding


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


class _LogitsOf:
    """The target as CachedDecoding sees it, keeping the logits of the last step (its ``feed``
    returns only their argmax)."""

    def __init__(self, target):
        self._target, self.logits = target, None

    def __getattr__(self, name):
        return getattr(self._target, name)

    def decode_step(self, *args, **kwargs):
        out = self._target.decode_step(*args, **kwargs)
        self.logits = out[0]
        return out


class CachedRows:
    """Each row with its own cache (``target_decoding.CachedDecoding``; see the module)."""

    def __init__(self, target, layer_ids: list[int]):
        self.target, self.layer_ids = target, list(layer_ids)
        self.rows: dict[int, tuple[CachedDecoding, _LogitsOf]] = {}

    def start(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        out = []
        for i, p in enumerate(prompts):
            seen = _LogitsOf(self.target)
            dec = CachedDecoding(seen, self.layer_ids)
            self.rows[i] = (dec, seen)
            dec.feed(list(p), last=1)
            out.append(seen.logits[0, -1])
        return out

    def verify(self, rows: list[int], feeds: list[list[int]]) -> list[torch.Tensor]:
        out = []
        for r, f in zip(rows, feeds):
            dec, seen = self.rows[r]
            dec.feed(list(f))
            out.append(seen.logits[0])
        return out

    def context(self, rows: list[int], lengths: list[int]) -> torch.Tensor:
        feats = [self.rows[r][0].features()[0, :S] for r, S in zip(rows, lengths)]
        S = max(lengths)
        out = feats[0].new_zeros((len(rows), S, feats[0].shape[-1]))
        for j, f in enumerate(feats):
            out[j, :f.shape[0]] = f
        return out

    def keep(self, row: int, length: int) -> None:
        self.rows[row][0].rewind(length)


def rows_backend(target, layer_ids: list[int], cache: bool, exact_head: bool = True):
    """The target's side of ``spec_decode.decode_rows``: the target's cache per row (``cache``:
    eval.cache, ``--cache``), else one full forward per round for all rows."""
    return CachedRows(target, layer_ids) if cache else FullBatch(target, layer_ids, exact_head)
