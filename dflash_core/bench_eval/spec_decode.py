"""Speculative decoding of a batch of prompts, greedy or sampled; plain decoding without a
drafter. The rules are ``models/evaluate.speculative_generate``'s, for many prompts at once:

1. Prefill: the target's token after each prompt (not a round).
2. Round, for every prompt still going: the drafter proposes after the last token from the
   features of the tokens before it (one drafter forward for all of them), never past the
   new-token limit; the target verifies each prompt's last token and drafts (one target forward
   for all, or one per prompt with ``--cache``); greedy accepts the longest prefix equal to the
   target's argmax (``greedy_accept``), sampled the speculative-sampling rule (sampling.py); the
   target's token after the accepted drafts is appended; the target keeps the last token and
   the accepted drafts.
3. A prompt stops at the limit or after a stop token (the target's end of turn).

Without a drafter every round feeds one token and appends the target's choice: plain decoding,
through the same target code, the baseline of the speedup and the reference of the lossless
check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_core.bench_eval.drafting import propose
from dflash_core.bench_eval.sampling import accept_sampled, choose
from dflash_core.models.evaluate import drafts_per_round, until_stop


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    stop_ids: frozenset = frozenset()


@dataclass
class RowOutput:
    tokens: list[int] = field(default_factory=list)  # new tokens only
    acceptance: list[int] = field(default_factory=list)  # drafts accepted, per round
    proposed: list[int] = field(default_factory=list)  # drafts proposed, per round
    # A drafter with a confidence head (DSpark): per round, its drafts' confidences (a round
    # without drafts records none), as models/evaluate records them for the calibration.
    confidences: list[list[float]] = field(default_factory=list)


def greedy_accept(drafts: list[int], preds: list[int]) -> int:
    """Drafts accepted: the longest prefix equal to the target's own choices."""
    n = 0
    while n < len(drafts) and drafts[n] == preds[n]:
        n += 1
    return n


@torch.no_grad()
def decode_rows(backend, drafter, prompts: list[list[int]], settings: DecodeSettings,
                gens: list | None = None) -> list[RowOutput]:
    """Decode ``prompts`` together through ``backend`` (target_batch.py) with ``drafter`` (None:
    plain decoding). ``gens``: one random generator per prompt (sampling only)."""
    T, stop, limit = settings.temperature, settings.stop_ids, settings.max_new_tokens
    if T > 0 and (gens is None or len(gens) != len(prompts)):
        raise ValueError("sampling needs one generator per prompt")
    gens = gens or [None] * len(prompts)
    ids = [list(p) for p in prompts]
    out = [RowOutput() for _ in prompts]
    if limit <= 0:
        return out
    for i, logits in enumerate(backend.start(ids)):
        tok = choose(logits, T, gens[i])
        ids[i].append(tok)
        out[i].tokens.append(tok)
    per_round = drafts_per_round(drafter, drafter.block_size) if drafter is not None else 0
    with_conf = per_round > 0 and getattr(drafter, "confidence_head", None) is not None

    def going(i: int) -> bool:
        return len(out[i].tokens) < limit and out[i].tokens[-1] not in stop

    active = [i for i in range(len(prompts)) if going(i)]
    while active:
        S = {i: len(ids[i]) - 1 for i in active}  # position of the last token
        # never draft past the limit: the target's own token fills the last place
        want = {i: min(per_round, limit - len(out[i].tokens) - 1) for i in active}
        drafts: dict[int, list[int]] = {i: [] for i in active}
        q: dict[int, torch.Tensor | None] = {i: None for i in active}
        conf: dict[int, list[float]] = {i: [] for i in active}
        drafting = [i for i in active if want[i] > 0]
        if drafting:
            ctx = backend.context(drafting, [S[i] for i in drafting])
            prop = propose(drafter, ctx.to(_device(drafter)), [S[i] for i in drafting],
                           [ids[i][-1] for i in drafting], T, [gens[i] for i in drafting])
            toks = prop.tokens.tolist()
            for j, i in enumerate(drafting):
                drafts[i] = toks[j][:want[i]]
                if prop.probs is not None:
                    q[i] = prop.probs[j, :want[i]]
            if with_conf:
                for j, c in enumerate(prop.confidences.tolist()):
                    conf[drafting[j]] = c[:want[drafting[j]]]
        logits = backend.verify(active, [[ids[i][-1]] + drafts[i] for i in active])
        for i, lg in zip(active, logits):
            d = drafts[i]
            if T > 0:
                accepted, nxt = accept_sampled(d, q[i], lg, T, gens[i])
            else:
                preds = lg.argmax(-1).tolist()
                accepted = greedy_accept(d, preds)
                nxt = preds[accepted]
            new = until_stop(d[:accepted] + [nxt], stop)
            ids[i].extend(new)
            out[i].tokens.extend(new)
            out[i].acceptance.append(len(new) - 1)
            out[i].proposed.append(len(d))
            if with_conf:
                out[i].confidences.append(conf[i])
            backend.keep(i, S[i] + accepted + 1)
        active = [i for i in active if going(i)]
    return out


def _device(drafter) -> torch.device:
    return next(drafter.parameters()).device
