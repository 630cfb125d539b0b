"""THE speculative decoding loop: a batch of prompts, greedy or sampled; plain decoding without a
drafter. Every evaluation decodes through it: ``dflash-tui eval`` (runner.py), the run's
evaluation of its prompt sets (run_sets.py) and of its held-out prompts
(``evaluate.evaluate_tau``, each prompt a batch of one), and ``check`` (check/decode.py).

1. Prefill: the target's token after each prompt (not a round).
2. Round, for every prompt still going: the drafter proposes after the last token from the
   features of the tokens before it (one drafter forward for all of them: the family's
   ``draft_batch``, drafting.py), never past the new-token limit; the target verifies each
   prompt's last token and drafts (target_decoding.py: one target forward for all, or one per
   prompt); greedy accepts the longest prefix equal to the target's argmax (``greedy_accept``),
   sampled the speculative-sampling rule (sampling.py); the target's token after the accepted
   drafts is appended; the target keeps the last token and the accepted drafts.
3. A prompt stops at the limit or after a stop token (the target's end of turn).

Greedy, the output is exactly the target's greedy decoding whatever the drafter proposes
(lossless), and tau = mean(accepted + 1) per round. Without a drafter (or at block size 1) every
round feeds one token and appends the target's choice: plain decoding, through the same target
code, the baseline of the speedup and the reference of the lossless check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_core.eval.drafting import (
    batched, drafts_per_round, propose, propose_each, records_confidence,
)
from dflash_core.eval.sampling import accept_sampled, choose


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    stop_ids: frozenset = frozenset()
    # None: the drafter's; a smaller one drafts fewer tokens per round; 1: plain decoding
    block_size: int | None = None
    # Greedy: also count every round as vLLM's counters do (RowOutput.served_acceptance): each
    # round drafts the family's full count, the last one too (past the new-token limit), and its
    # drafts the target accepts are counted whole, past a stop token or the limit. The tokens
    # kept are the same: only the drafts within the limit are taken.
    count_whole: bool = False
    # the target's positions (max_position_embeddings; None: not known): counting whole never
    # drafts past them (vLLM trims its drafts at max_model_len alike)
    positions: int | None = None


@dataclass
class RowOutput:
    tokens: list[int] = field(default_factory=list)  # new tokens only
    acceptance: list[int] = field(default_factory=list)  # drafts accepted, per round
    proposed: list[int] = field(default_factory=list)  # drafts proposed, per round
    # A drafter with a confidence head (DSpark): per round, its drafts' confidences (a round
    # without drafts records none): the calibration's input.
    confidences: list[list[float]] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # the drafted tokens, per round
    # per round, its position: the tokens before its drafts, the prompt's and those generated so
    # far (context_buckets.py counts acceptance by it)
    positions: list[int] = field(default_factory=list)
    # DecodeSettings.count_whole: per round, the drafts accepted counted as vLLM counts them (of
    # the full count drafted, past the limit and a stop token); every round drafted the full count
    served_acceptance: list[int] = field(default_factory=list)
    served_proposed: list[int] = field(default_factory=list)  # the drafts of each such round


def stop_set(eos_token_id) -> frozenset[int]:
    """Stop ids from one id, several (a chat target's end of turn and end of text) or None."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, (list, tuple, set, frozenset)):
        return frozenset(int(i) for i in eos_token_id)
    return frozenset([int(eos_token_id)])


def until_stop(new: list[int], stops) -> list[int]:
    """A round's new tokens up to and including the first stop id: the target stops there, so
    does the decoding."""
    for k, t in enumerate(new):
        if t in stops:
            return new[:k + 1]
    return new


def greedy_accept(drafts: list[int], preds: list[int]) -> int:
    """Drafts accepted: the longest prefix equal to the target's own choices."""
    n = 0
    while n < len(drafts) and drafts[n] == preds[n]:
        n += 1
    return n


def block_size_of(drafter, block_size: int | None) -> int:
    """The block size decoding runs at: ``block_size`` (checked against the drafter's), else
    the drafter's; 1 without a drafter."""
    B = block_size or (drafter.block_size if drafter is not None else 1)
    if B < 1:
        raise ValueError(f"block_size must be >= 1, got {B}")
    if B > 1:
        if drafter is None:
            raise ValueError("block_size > 1 needs a drafter")
        if B > drafter.block_size:
            raise ValueError(f"block_size {B} exceeds the drafter's block size "
                             f"{drafter.block_size}")
    return B


def _draft(drafter, ctx: torch.Tensor, lengths: list[int], last: list[int], counts: list[int],
           temperature: float, gens: list) -> tuple[list[list[int]], list, list | None]:
    """Each drafting row's drafts (``counts[j]`` at most), the distributions they were drawn
    from (sampled; else None each) and their confidences (None: the drafter has none)."""
    if not batched(drafter):  # one context at a time: greedy, no confidences
        if temperature > 0:
            raise ValueError("sampled decoding needs a drafter that drafts a batch")
        toks = propose_each(drafter, ctx, lengths, last, counts).tokens.tolist()
        # a row shorter than the longest is padded with -1 (no token)
        rows = [[t for t in r[:n] if t >= 0] for r, n in zip(toks, counts)]
        return rows, [None] * len(rows), None
    prop = propose(drafter, ctx, lengths, last, temperature, gens)
    toks = [r[:n] for r, n in zip(prop.tokens.tolist(), counts)]
    q = ([prop.probs[j, :n] for j, n in enumerate(counts)] if prop.probs is not None
         else [None] * len(toks))
    conf = (None if prop.confidences is None
            else [c[:n] for c, n in zip(prop.confidences.tolist(), counts)])
    return toks, q, conf


@torch.no_grad()
def decode_rows(backend, drafter, prompts: list[list[int]], settings: DecodeSettings,
                gens: list | None = None) -> list[RowOutput]:
    """Decode ``prompts`` together through ``backend`` (target_decoding.py: ``FullBatch``,
    ``Rows``) with ``drafter`` (None: plain decoding). ``gens``: one random generator per
    prompt (sampling only)."""
    T, stop, limit = settings.temperature, settings.stop_ids, settings.max_new_tokens
    if T > 0 and (gens is None or len(gens) != len(prompts)):
        raise ValueError("sampling needs one generator per prompt")
    per_round = drafts_per_round(drafter, block_size_of(drafter, settings.block_size))
    with_conf = per_round > 0 and records_confidence(drafter)
    whole = settings.count_whole and T == 0 and per_round > 0
    gens = gens or [None] * len(prompts)
    ids = [list(p) for p in prompts]
    out = [RowOutput() for _ in prompts]
    if limit <= 0:
        return out
    for i, logits in enumerate(backend.start(ids)):
        tok = choose(logits, T, gens[i])
        ids[i].append(tok)
        out[i].tokens.append(tok)

    def going(i: int) -> bool:
        return len(out[i].tokens) < limit and out[i].tokens[-1] not in stop

    active = [i for i in range(len(prompts)) if going(i)]
    while active:
        S = {i: len(ids[i]) - 1 for i in active}  # position of the last token
        # never draft past the limit: the target's own token fills the last place
        want = {i: min(per_round, limit - len(out[i].tokens) - 1) for i in active}
        # drafted: the full count when counting whole (vLLM drafts it up to the last round)
        ask = {i: max(want[i], min(per_round, (settings.positions or 1 << 62) - len(ids[i])))
               if whole else want[i] for i in active}
        drafts: dict[int, list[int]] = {i: [] for i in active}
        full: dict[int, list[int]] = {i: [] for i in active}
        q: dict[int, torch.Tensor | None] = {i: None for i in active}
        conf: dict[int, list[float]] = {i: [] for i in active}
        drafting = [i for i in active if ask[i] > 0]
        if drafting:
            lengths = [S[i] for i in drafting]
            ctx = backend.context(drafting, lengths).to(_device(drafter))
            toks, qs, confs = _draft(drafter, ctx, lengths, [ids[i][-1] for i in drafting],
                                     [ask[i] for i in drafting], T,
                                     [gens[i] for i in drafting])
            for j, i in enumerate(drafting):
                full[i] = toks[j]
                drafts[i], q[i] = toks[j][:max(0, want[i])], qs[j]
                if with_conf and confs is not None:
                    conf[i] = confs[j][:max(0, want[i])]
        logits = backend.verify(active, [[ids[i][-1]] + (full[i] if whole else drafts[i])
                                         for i in active])
        for i, lg in zip(active, logits):
            d = drafts[i]
            if T > 0:
                accepted, nxt = accept_sampled(d, q[i], lg, T, gens[i])
            else:
                preds = lg.argmax(-1).tolist()
                accepted = greedy_accept(d, preds)
                nxt = preds[accepted]
                if whole:
                    out[i].served_acceptance.append(greedy_accept(full[i], preds))
                    out[i].served_proposed.append(len(full[i]))
            new = until_stop(d[:accepted] + [nxt], stop)
            out[i].positions.append(S[i] + 1)
            ids[i].extend(new)
            out[i].tokens.extend(new)
            out[i].acceptance.append(len(new) - 1)
            out[i].proposed.append(len(d))
            out[i].drafts.append(d)
            if with_conf:
                out[i].confidences.append(conf[i])
            # kept: up to the last accepted draft; the next token is fed with the next drafts
            backend.keep(i, S[i] + accepted + 1)
        active = [i for i in active if going(i)]
    return out


def _device(drafter) -> torch.device:
    try:
        return next(drafter.parameters()).device
    except (AttributeError, StopIteration):  # a stub without weights
        return torch.device("cpu")
