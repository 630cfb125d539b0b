"""Exact speculative decoding of one prompt or of held-out prompts, one at a time, through the one
decoding loop (spec_decode.decode_rows, each prompt a batch of one), the acceptance length tau it
measures (docs/algorithm.md), and the teacher-forced tau the run's evaluation compares it with.

A round: the drafter proposes its drafts after the last accepted token from the target features
of the accepted context (B-1 for DFlash; B for DSpark, whose anchor slot predicts, chained
through its Markov head, with each round's confidences recorded for
models/dspark/calibration.py); ONE target forward over context + block verifies them; the
longest prefix equal to the target's own argmax is accepted and the target's next argmax (the
"bonus" token) is appended. The output is exactly the target's greedy decoding, whatever the
drafter proposes (lossless), and tau = mean(accepted + 1) per round.

The target's state between rounds is a ``target_decoding.Decoding``: a full forward over the whole
sequence per round (any ``TargetFn``), or the target's cache (``target_fn_for(..., cache=True)``),
cut back to the accepted tokens after each round.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Collection, Protocol, Sequence

import numpy as np
import torch

from dflash_core.acceptance import histogram, pooled_tau
from dflash_core.context_buckets import round_positions
from dflash_core.eval.drafting import drafts_per_round
from dflash_core.eval.spec_decode import DecodeSettings, block_size_of, decode_rows, stop_set
from dflash_core.eval.target_decoding import (  # the one-prompt TargetFns, importable from here
    FullDecoding,
    ModelTarget,
    TargetFn,
    features_fn_for,
    fn_rows,
    hf_target_fn,
    target_fn_for,
)

__all__ = ["EVAL_ATTENTION", "Drafter", "EvalSummary", "GenResult", "ModelTarget", "TargetFn",
           "drafts_per_round", "evaluate_tau", "evaluation_attention", "features_fn_for",
           "hf_target_fn", "plain_greedy", "pooled_tau", "speculative_generate",
           "target_fn_for", "teacher_forced_eval"]


class Drafter(Protocol):
    """What decoding needs from a drafter: a family's ``draft_batch`` (models/proposal.py), or
    one context at a time (``draft``: the reference implementation in check, a test stub)."""

    block_size: int
    target_layer_ids: list[int]

    def draft(self, context: torch.Tensor, last_token: int,
              num_tokens: int | None = None) -> torch.Tensor: ...


@dataclass
class GenResult:
    tokens: list[int]  # new tokens only (prompt excluded)
    acceptance: list[int] = field(default_factory=list)  # drafted tokens accepted, per round
    # Per round, the confidence of each draft (a drafter with a confidence head only).
    confidences: list[list[float]] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # the drafted tokens, per round
    proposed: list[int] = field(default_factory=list)  # drafts proposed, per round
    positions: list[int] = field(default_factory=list)  # each round's (spec_decode.RowOutput)

    @property
    def rounds(self) -> int:
        return len(self.acceptance)

    @property
    def tau(self) -> float:
        """Mean tokens gained per verification round (accepted + bonus)."""
        return sum(a + 1 for a in self.acceptance) / max(1, self.rounds)


@dataclass
class EvalSummary:
    tau: float  # pooled over all rounds of all prompts
    acceptance: list[int]  # histogram: acceptance[k] = rounds that accepted k drafted tokens
    prompts: int
    tokens: int  # new tokens generated, all prompts together
    rounds: int = 0
    # Per prompt, the tokens decoding produced: the target's own greedy continuation (decoding is
    # lossless), which the teacher-forced measure of acceptance.py runs on.
    outputs: list[list[int]] = field(default_factory=list)
    # Per prompt, the position of each round's last accepted token (its anchor): where a
    # teacher-forced block scores exactly what that round accepted.
    anchors: list[list[int]] = field(default_factory=list)
    # A drafter with a confidence head: per round of all prompts, its drafts' confidences and how
    # many of them were accepted (models/dspark/calibration.calibrate's input).
    confidences: list[list[float]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)  # histogram: rounds that proposed j drafts
    # Per prompt, each round's position (the tokens before its drafts; its anchor is one before)
    # and drafts accepted: acceptance by context length (context_buckets.py).
    positions: list[list[int]] = field(default_factory=list)
    rounds_accepted: list[list[int]] = field(default_factory=list)

    def by_context(self, buckets) -> list[dict]:
        """Rounds, accepted drafts and tau per bucket of ``buckets`` (context_buckets.Buckets)."""
        from dflash_core.context_buckets import by_context

        return by_context(buckets, zip(self.positions, self.rounds_accepted))


def _as_ids(prompt_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(prompt_ids, torch.Tensor):
        return [int(t) for t in prompt_ids.reshape(-1).tolist()]
    return [int(t) for t in prompt_ids]


def _check_layers(drafter, layer_ids) -> None:
    if layer_ids is not None and drafter is not None:
        ids = list(getattr(drafter, "target_layer_ids", layer_ids))
        if ids != list(layer_ids):
            raise ValueError(f"the drafter was trained on target layers {ids}, "
                             f"but features come from {list(layer_ids)}")


def _drafter_device(drafter) -> torch.device:
    try:
        return next(drafter.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def anchors_of(prompt_len: int, acceptance: Sequence[int]) -> list[int]:
    """The position of each round's last accepted token (its anchor) after a prompt: the last
    token before its drafts, one before the round's position (context_buckets.round_positions)."""
    return [p - 1 for p in round_positions(prompt_len, acceptance)]


@torch.no_grad()
def speculative_generate(target_fn: TargetFn, drafter: Drafter | None,
                         prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                         layer_ids: Sequence[int] | None = None, block_size: int | None = None,
                         *, eos_token_id: int | Collection[int] | None = None,
                         device="cpu") -> GenResult:
    """Greedy speculative decoding of ``max_new_tokens`` after ``prompt_ids``: the one loop
    (spec_decode.decode_rows) with a batch of one.

    ``block_size`` defaults to the drafter's; a smaller one drafts fewer tokens per round; 1 is
    plain decoding (the drafter is never called; every round accepts 0). ``layer_ids``, when given,
    must be the layers the drafter was trained on (``target_fn`` must return their features).
    Decoding stops after ``eos_token_id`` when given (one id, or several: a chat target's end
    of turn and its end of text). ``device`` is where input ids are built for
    ``target_fn``.
    """
    ids = _as_ids(prompt_ids)
    if not ids:
        raise ValueError("the prompt must hold at least one token")
    B = block_size_of(drafter, block_size)
    if B > 1:
        _check_layers(drafter, layer_ids)
    settings = DecodeSettings(max_new_tokens, 0.0, stop_set(eos_token_id), B)
    (row,) = decode_rows(fn_rows(target_fn, device), drafter, [ids], settings)
    return GenResult(row.tokens, row.acceptance, row.confidences, row.drafts, row.proposed,
                     row.positions)


@torch.no_grad()
def plain_greedy(target_fn: TargetFn, prompt_ids: Sequence[int] | torch.Tensor, n: int, *,
                 eos_token_id: int | None = None, device="cpu") -> list[int]:
    """The target's own greedy continuation (one full forward per token): the lossless reference,
    kept apart from the loop it judges."""
    dec, new = FullDecoding(target_fn, device), _as_ids(prompt_ids)
    out: list[int] = []
    while len(out) < n and (not out or out[-1] != eos_token_id):
        out.append(int(dec.feed(new, last=1)[-1].argmax(-1)))
        new = [out[-1]]
    return out


@torch.no_grad()
def evaluate_tau(target_fn: TargetFn, drafter: Drafter | None,
                 prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int,
                 layer_ids: Sequence[int] | None = None, block_size: int | None = None, *,
                 eos_token_id: int | Collection[int] | None = None,
                 device="cpu") -> EvalSummary:
    """Exact tau over held-out prompts: mean of (accepted + 1) over all rounds of all prompts."""
    B = block_size or (drafter.block_size if drafter is not None else 1)
    hist = [0] * max(B, drafts_per_round(drafter, B) + 1)  # index: drafts accepted
    outputs, anchors, confidences, accepted, proposed = [], [], [], [], []
    positions, rounds_accepted = [], []
    for prompt in prompts:
        r = speculative_generate(target_fn, drafter, prompt, max_new_tokens, layer_ids, B,
                                 eos_token_id=eos_token_id, device=device)
        for a in r.acceptance:
            hist[a] += 1
        proposed += r.proposed
        if r.confidences:
            confidences.extend(r.confidences)
            accepted.extend(r.acceptance)
        outputs.append(r.tokens)
        anchors.append([p - 1 for p in r.positions])
        positions.append(list(r.positions))
        rounds_accepted.append(list(r.acceptance))
    return EvalSummary(tau=pooled_tau(hist), acceptance=hist,
                       prompts=len(prompts), tokens=sum(map(len, outputs)), rounds=sum(hist),
                       outputs=outputs, anchors=anchors, confidences=confidences,
                       accepted=accepted, proposed=histogram(proposed, len(hist)),
                       positions=positions, rounds_accepted=rounds_accepted)


@torch.no_grad()
def teacher_forced_eval(features_fn: Callable[[torch.Tensor], torch.Tensor], drafter,
                        sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
                        chunk: int = 4096,
                        anchors: Sequence[Sequence[int]] | None = None) -> tuple[float, int]:
    """(tau, blocks): teacher-forced tau of ``drafter`` on ``sequences`` of (input_ids,
    loss_mask), features from ``features_fn(ids [1, T]) -> [1, T, k*H]``. The drafter pass is the
    one training makes (same block inputs, attention and loss code), so whatever training's
    drafter sees, this one sees too; exact decoding cannot.

    Anchors: ``anchors[i]`` for sequence i (e.g. ``EvalSummary.anchors``: a block there scores
    what that decoding round accepted, so on the decoded text the two agree unless training and
    decoding differ), else every valid position (a mean over all positions, which runs above
    exact tau: decoding's rounds start where the last draft failed, the hard places)."""
    from dflash_core.models import objective as obj

    dev = _drafter_device(drafter)
    total, blocks = 0.0, 0
    for i, (ids_seq, mask_seq) in enumerate(sequences):
        ids = torch.tensor([_as_ids(ids_seq)], dtype=torch.long)
        mask = torch.tensor([[int(m) for m in mask_seq]], dtype=torch.long)
        valid = obj.valid_anchor_positions(mask[0].numpy())
        if anchors is not None:
            valid = np.intersect1d(valid, np.asarray(anchors[i], dtype=np.int64))
        if len(valid) == 0:
            continue
        at = torch.from_numpy(valid.astype(np.int64))[None]
        labels = obj.block_labels(ids, mask, at, drafter.label_width).to(dev)
        feats = features_fn(ids).to(dev)
        ids, at = ids.to(dev), at.to(dev)
        bids, pos = drafter.block_inputs(ids, at)
        embeds = drafter.embed_tokens(bids).to(drafter.fc.weight.dtype)
        hidden = drafter(feats, embeds, pos, at)
        # the family scores its own blocks (DSpark: its labels and its chain's predictions)
        tau_sum, n = drafter.teacher_forced_tau(hidden, labels, ids, at, chunk)
        total += tau_sum
        blocks += n
    return (total / blocks if blocks else 0.0), blocks


# The evaluation and `check` decode with the uncompiled attention ("chunked", exact, the same
# figures): decoding runs one block after a context that grows every round, and the
# teacher-forced measures run shapes training never sees, so compiled FlexAttention compiled and
# autotuned again at evaluations, and on an H200 inductor found no kernel for one of them
# (NoValidChoicesError at step 200 of the demo, one process). For one block the uncompiled
# attention is also faster: 0.42-0.46 ms per call against 2-7 ms compiled at an 8B drafter's
# shape on an H200 (bench/flex_decoding.py --time; bench/BENCHMARKS.md "Evaluation attention").
EVAL_ATTENTION = "chunked"


@contextmanager
def evaluation_attention(drafter):
    """The drafter in eval mode with ``EVAL_ATTENTION`` inside; training's mode and attention
    are restored after."""
    was_training, attn = drafter.training, drafter.attn_impl
    drafter.eval()
    drafter.attn_impl = EVAL_ATTENTION
    try:
        yield drafter
    finally:
        drafter.attn_impl = attn
        drafter.train(was_training)
