"""Exact greedy speculative decoding, and the acceptance length tau it measures
(docs/algorithm.md).

A round: the drafter proposes B-1 tokens after the last accepted token from the target features of
the accepted context; ONE target forward over context + block verifies them; the longest prefix
equal to the target's own argmax is accepted and the target's next argmax (the "bonus" token) is
appended. The output is exactly the target's greedy decoding, whatever the drafter proposes
(lossless), and tau = mean(accepted + 1) per round.

A drafter whose anchor slot predicts too (``anchor_predicts``: DSpark) proposes B tokens per
round, chain-drafted through its Markov head, and all B are verified (tau <= B+1); when it has a
confidence head, each round's confidences are recorded for dspark_calibration.py.

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

from dflash_core.models.target_decoding import CachedDecoding, Decoding, FullDecoding, TargetFn


class Drafter(Protocol):
    """What decoding needs from a drafter (DFlashDrafter, or a test stub)."""

    block_size: int
    target_layer_ids: list[int]

    def draft(self, context: torch.Tensor, last_token: int,
              num_tokens: int | None = None) -> torch.Tensor: ...


def drafts_per_round(drafter, block_size: int) -> int:
    """Tokens a round proposes at ``block_size``: B-1, or B for a drafter whose anchor slot
    predicts (DSpark); block size 1 is plain decoding for either."""
    if block_size <= 1 or drafter is None:
        return 0
    return block_size - 1 + int(bool(getattr(drafter, "anchor_predicts", False)))


@dataclass
class GenResult:
    tokens: list[int]  # new tokens only (prompt excluded)
    acceptance: list[int] = field(default_factory=list)  # drafted tokens accepted, per round
    # Per round, the confidence of each draft (a drafter with a confidence head only).
    confidences: list[list[float]] = field(default_factory=list)

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
    # many of them were accepted (dspark_calibration.calibrate's input).
    confidences: list[list[float]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


def _stop_set(eos_token_id) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, (list, tuple, set, frozenset)):
        return frozenset(int(i) for i in eos_token_id)
    return frozenset([int(eos_token_id)])


def pooled_tau(hist: Sequence[int]) -> float:
    """Tokens gained per round over all rounds of all prompts, from the histogram of drafts
    accepted per round (hist[k]: rounds that accepted k); 0 without a round."""
    rounds = sum(hist)
    return sum((k + 1) * n for k, n in enumerate(hist)) / rounds if rounds else 0.0


def until_stop(new: list[int], stops) -> list[int]:
    """A round's new tokens up to and including the first stop id: the target stops there, so
    does the decoding."""
    for k, t in enumerate(new):
        if t in stops:
            return new[:k + 1]
    return new


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


@torch.no_grad()
def speculative_generate(target_fn: TargetFn, drafter: Drafter | None,
                         prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                         layer_ids: Sequence[int] | None = None, block_size: int | None = None,
                         *, eos_token_id: int | Collection[int] | None = None,
                         device="cpu") -> GenResult:
    """Greedy speculative decoding of ``max_new_tokens`` after ``prompt_ids``.

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
    stops = _stop_set(eos_token_id)
    B = block_size or (drafter.block_size if drafter is not None else 1)
    if B < 1:
        raise ValueError(f"block_size must be >= 1, got {B}")
    if B > 1:
        if drafter is None:
            raise ValueError("block_size > 1 needs a drafter")
        if B > drafter.block_size:
            raise ValueError(f"block_size {B} exceeds the drafter's block size "
                             f"{drafter.block_size}")
        _check_layers(drafter, layer_ids)
    result = GenResult(tokens=[])
    if max_new_tokens <= 0:
        return result

    dec: Decoding = (getattr(target_fn, "decoding", lambda: None)()
                     or FullDecoding(target_fn, device))
    # Prefill: the target's first token is not a round (no draft was verified).
    ids.append(int(dec.feed(list(ids), last=1)[-1]))
    result.tokens.append(ids[-1])
    draft_dev = _drafter_device(drafter) if B > 1 else None
    per_round = drafts_per_round(drafter, B)
    with_conf = (per_round > 0 and hasattr(drafter, "draft_with_confidence")
                 and getattr(drafter, "confidence_head", None) is not None)

    while len(result.tokens) < max_new_tokens and ids[-1] not in stops:
        left = max_new_tokens - len(result.tokens)
        S = len(ids) - 1  # position of the last accepted token; features exist for 0..S-1
        n_draft = min(per_round, left - 1)  # never draft past the end: the bonus token fills it
        drafted: list[int] = []
        conf = None
        if n_draft > 0:
            ctx = dec.features()[:, :S].to(draft_dev)
            if with_conf:
                toks, conf = drafter.draft_with_confidence(ctx, ids[-1], n_draft)
            else:
                toks = drafter.draft(ctx, ids[-1], n_draft)
            drafted = [int(t) for t in toks.tolist()][:n_draft]
        if with_conf:  # a round without drafts (the last token) records none
            result.confidences.append([] if conf is None else
                                      [float(c) for c in conf.tolist()][:n_draft])
        # preds[j] is the target's choice for position S + j + 1, where drafted[j] sits.
        preds = dec.feed([ids[S]] + drafted)
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == int(preds[accepted]):
            accepted += 1
        new = until_stop(drafted[:accepted] + [int(preds[accepted])], stops)
        ids.extend(new)
        result.tokens.extend(new)
        result.acceptance.append(len(new) - 1)
        # Kept: up to the last accepted draft; the bonus token is fed with the next round's draft.
        dec.rewind(S + accepted + 1)
    return result


@torch.no_grad()
def plain_greedy(target_fn: TargetFn, prompt_ids: Sequence[int] | torch.Tensor, n: int, *,
                 eos_token_id: int | None = None, device="cpu") -> list[int]:
    """The target's own greedy continuation (one full forward per token): the lossless reference."""
    dec, new = FullDecoding(target_fn, device), _as_ids(prompt_ids)
    out: list[int] = []
    while len(out) < n and (not out or out[-1] != eos_token_id):
        out.append(int(dec.feed(new, last=1)[-1]))
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
    hist = [0] * (B + int(B > 1 and bool(getattr(drafter, "anchor_predicts", False))))
    outputs, anchors, confidences, accepted = [], [], [], []
    for prompt in prompts:
        r = speculative_generate(target_fn, drafter, prompt, max_new_tokens, layer_ids, B,
                                 eos_token_id=eos_token_id, device=device)
        for a in r.acceptance:
            hist[a] += 1
        if r.confidences:
            confidences.extend(r.confidences)
            accepted.extend(r.acceptance)
        outputs.append(r.tokens)
        starts, at = [], len(_as_ids(prompt))
        for a in r.acceptance:
            starts.append(at)
            at += a + 1
        anchors.append(starts)
    return EvalSummary(tau=pooled_tau(hist), acceptance=hist,
                       prompts=len(prompts), tokens=sum(map(len, outputs)), rounds=sum(hist),
                       outputs=outputs, anchors=anchors, confidences=confidences,
                       accepted=accepted)


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
    from dflash_core.models.dspark import loss as dspark_loss
    from dflash_core.models import objective as obj

    dev = _drafter_device(drafter)
    # DSpark's labels come one slot wider in DFlash's layout (dspark_loss.dspark_targets).
    dsp = bool(getattr(drafter, "anchor_predicts", False))
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
        labels = obj.block_labels(ids, mask, at, drafter.block_size + int(dsp)).to(dev)
        feats = features_fn(ids).to(dev)
        ids, at = ids.to(dev), at.to(dev)
        bids, pos = drafter.block_inputs(ids, at)
        embeds = drafter.embed_tokens(bids).to(drafter.fc.weight.dtype)
        hidden = drafter(feats, embeds, pos, at)
        if dsp:
            labels, prev = dspark_loss.dspark_targets(labels, dspark_loss.anchor_tokens(ids, at))
            preds = dspark_loss.teacher_forced_preds(drafter, hidden, prev, chunk)
            total += float(dspark_loss.tau_sum(preds, labels))
            blocks += int((labels[..., 0] != obj.IGNORE).sum())
            continue
        out = obj.chunked_loss(hidden, labels, drafter.lm_head.weight, 1.0, chunk)
        total += float(out.tau_sum)
        blocks += out.blocks
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


def features_fn_for(target_model, layer_ids: Sequence[int] | None):
    """``target.TargetModel.features`` of ``layer_ids`` as ``fn(ids [1, T]) -> [1, T, k*H]``."""
    ids = list(layer_ids) if layer_ids is not None else None
    return lambda input_ids: target_model.features(input_ids, layer_ids=ids)


class ModelTarget:
    """A ``target.TargetModel`` as a TargetFn (its ``logits_and_features``); with ``cache``,
    decoding keeps the target's cache between rounds (``CachedDecoding``)."""

    def __init__(self, target_model, layer_ids: Sequence[int] | None, cache: bool = False):
        self.model, self.cache = target_model, cache
        self.layer_ids = list(layer_ids) if layer_ids is not None else None

    def __call__(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.logits_and_features(input_ids, self.layer_ids)

    def decoding(self) -> Decoding | None:
        """A new prompt's state with the cache; None: decoding's full forwards."""
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
