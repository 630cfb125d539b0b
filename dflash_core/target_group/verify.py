"""A target group's verify forwards, the ranks' side: the forwards speculative decoding and the
evaluation ask of the target (docs/targets.md, "Targets larger than one GPU"), run by every rank
of the copy on the same inputs, rank 0 answering. The engine's side is remote.py.

Request (every rank's request queue, in the same order on each): ("verify", vseq, op, args).
Reply (the group's verify queue, rank 0 only): ("verified", vseq, result). A rank that fails puts
("rank-error", rank, error) there too (rank.main), so the engine waiting on a reply names it.

The ops:
- "forward": rows of tokens, each row's fed tail (the last ``fed`` tokens of it); one forward
  over all rows, right-padded. Returns the target's logits at each row's fed positions and the
  features there (never the whole rows': the engine keeps the features of what it fed before).
  With ``exact_head`` the logits are the lm_head of the post-norm last hidden state at those
  positions only (target_decoding.FullBatch's rule), else the model's own logits.
- "feed" / "rewind": one row's state with the target's cache (target_decoding.CachedDecoding),
  kept here by key: the engine's ``RemoteCached`` drives it. A rewind answers only where the
  cache cannot be cut back (recurrent layers feed the kept tokens again; their features come
  back).
- "features", "logits_and_features", "hidden_states": the TargetModel's / the model's own
  forwards (the teacher-forced measures, the check's memorising and feature probe).
- "exact_head", "agreement": target_decoding.head_is_lm_head and models/agreement's
  label_agreement, run here (the lm_head is split between the ranks).
Every request may carry ``drop``: keys of cached rows the engine no longer holds.

Under FSDP (sharded) every rank runs the forward of the same rows (each layer is gathered from
every rank, so all must); under tensor parallel each rank its share of every layer.
"""

from __future__ import annotations

import torch

NO_REPLY = object()  # an op the engine does not wait for (a rewind that cuts the cache back)


def _padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    T = max(map(len, rows))
    ids = torch.zeros((len(rows), T), dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids.to(device), (None if bool(mask.all()) else mask.to(device))


def _module_argmax(hidden: torch.Tensor, lm_head, chunk: int) -> torch.Tensor:
    """agreement.greedy_at through the lm_head module (its weight is split between the ranks,
    so only its forward sees it whole); ties go to the lowest id as there."""
    return lm_head(hidden.to(lm_head.weight.dtype)).float().argmax(-1)


class Verifier:
    """The ops above on one rank's loaded TargetModel."""

    def __init__(self, model):
        self.model = model
        self.cached: dict = {}  # key -> CachedDecoding

    def run(self, op: str, args: dict):
        for key in args.get("drop", ()):
            self.cached.pop(key, None)
        return getattr(self, f"_{op}")(**{k: v for k, v in args.items() if k != "drop"})

    # -- decoding ------------------------------------------------------------------------------
    @torch.no_grad()
    def _forward(self, rows: list[list[int]], fed: list[int], layer_ids: list[int],
                 exact_head: bool, last: list[int] | None = None):
        """(logits [m, F, V], features [m, F, k*H]): at each row's last ``last[j]`` (default
        ``fed[j]``) positions the logits, at its last ``fed[j]`` the features; row j's first
        slots hold them, the rest is padding."""
        m = self.model
        ids, mask = _padded(rows, m.device)
        lens = [len(r) for r in rows]
        last = last or fed
        F, L = max(fed), max(last)
        kH = len(layer_ids) * m.hidden_size
        if exact_head:
            feats = m.features(ids, mask, layer_ids, with_last_hidden=True)
            ctx, h = feats[..., :kH], feats[..., kH:]
            at = self._at(lens, last, L, h.shape[1], h.device)
            sel = torch.gather(h, 1, at[..., None].expand(-1, -1, h.shape[-1]))
            logits = m.lm_head(sel.to(m.lm_head.weight.dtype))
        else:
            full, ctx = m.logits_and_features(ids, layer_ids, mask)
            at = self._at(lens, last, L, full.shape[1], full.device)
            logits = torch.gather(full, 1, at[..., None].expand(-1, -1, full.shape[-1]))
        at = self._at(lens, fed, F, ctx.shape[1], ctx.device)
        feats = torch.gather(ctx, 1, at[..., None].expand(-1, -1, ctx.shape[-1]))
        return logits.contiguous(), feats.contiguous()

    @staticmethod
    def _at(lens: list[int], tail: list[int], width: int, T: int, device) -> torch.Tensor:
        """Each row's last ``tail[j]`` positions in its first slots (a shorter tail's slots past
        it read its last position)."""
        return torch.tensor([[min(T - 1, L - n + k) for k in range(width)]
                             for L, n in zip(lens, tail)], device=device)

    @torch.no_grad()
    def _feed(self, key, tokens: list[int], last: int, layer_ids: list[int]):
        """One cached row fed ``tokens``: (logits after them [n or last, V], their features)."""
        from dflash_core.eval.target_decoding import CachedDecoding

        dec = self.cached.get(key)
        if dec is None:
            dec = self.cached[key] = CachedDecoding(self.model, layer_ids)
        logits = dec.feed(list(tokens), last)
        return logits.clone(), dec.features()[:, -len(tokens):].clone()

    @torch.no_grad()
    def _rewind(self, key, length: int, since: int):
        """Keep the row's first ``length`` tokens; where the cache was taken back and tokens fed
        again, the features of tokens ``since``..``length`` (the engine replaces its own)."""
        dec = self.cached[key]
        refeeds = not dec.croppable and len(dec.tokens) > length
        dec.rewind(length)
        return dec.features()[:, since:length].clone() if refeeds else NO_REPLY

    # -- the evaluation's and the check's other forwards ---------------------------------------
    @torch.no_grad()
    def _features(self, input_ids, attention_mask, layer_ids, with_last_hidden: bool):
        return self.model.features(input_ids, attention_mask, layer_ids,
                                   with_last_hidden=with_last_hidden)

    @torch.no_grad()
    def _logits_and_features(self, input_ids, layer_ids, attention_mask):
        return self.model.logits_and_features(input_ids, layer_ids, attention_mask)

    @torch.no_grad()
    def _hidden_states(self, input_ids):
        """transformers' own hidden states of the whole model (the check's feature probe)."""
        m = self.model
        with m._no_autograd():
            out = m.model(input_ids=input_ids.to(m.device), output_hidden_states=True,
                          use_cache=False)
        return tuple(h.clone() for h in out.hidden_states)

    def _exact_head(self, probe: list[int], layer_ids: list[int]) -> bool:
        from dflash_core.eval.target_decoding import head_is_lm_head

        return head_is_lm_head(self.model, probe, layer_ids)

    def _agreement(self, input_ids, loss_mask, max_positions: int, chunk: int, seed: int):
        from dflash_core.models.agreement import label_agreement

        return label_agreement(self.model, input_ids, loss_mask, max_positions, chunk, seed,
                               greedy=_module_argmax)
