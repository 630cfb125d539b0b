"""The run's evaluation, owned in one place: the measures of acceptance (acceptance.py) on
the held-out prompts with the first target and the first replica, the data/target agreement, the
training tau of the recent steps, and the prompts themselves; then exact tau on each named prompt
set of eval.prompt_sets (eval/run_sets.py). The run says when; this measures, publishes,
and gives back the exact tau checkpoints/best follows (eval.best_set; the checkpointer keeps
it)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from dflash_core.config import EvalConfig
from dflash_core import acceptance
from dflash_core.context_buckets import buckets_of
from dflash_core.eval.drafter_dtype import SERVED, parameter_dtype, served_copy
from dflash_core.eval.evaluate import evaluate_tau, evaluation_attention, teacher_forced_eval
from dflash_core.eval.run_sets import RunSet, evaluate_set
from dflash_core.eval.target_decoding import features_fn_for, head_is_lm_head, target_fn_for
from dflash_core.models.agreement import label_agreement
from dflash_core.models.dspark.calibration import calibrate
from dflash_core.observe.events import EvalResult, Log


class Evaluator:
    """Made at warm-up. ``dataset`` / ``eval_indices``: the run's data and its held-out split;
    ``max_length``: data.max_length (held-out samples are cut as training cuts them);
    ``loss_chunk``: drafter.loss_chunk; ``seed``: run.seed (the agreement's sample); ``sets``:
    eval.prompt_sets as preflight rendered them (run_sets.RunSet); ``served_dtype``:
    drafter.dtype, what eval.drafter_dtype "served" decodes in (drafter_dtype.py);
    ``provenance``: where the data's responses came from (its manifest's, data/provenance.py),
    which the data finding names."""

    def __init__(self, cfg: EvalConfig, publish: Callable[[Any], None], *, dataset,
                 eval_indices, layer_ids: list[int], max_length: int, loss_chunk: int, seed: int,
                 sets: Sequence[RunSet] = (), served_dtype: str = "bfloat16",
                 provenance: dict | None = None):
        self.cfg, self.publish, self.sets = cfg, publish, list(sets)
        self.provenance = provenance
        self.dtype = served_dtype if cfg.drafter_dtype == SERVED else cfg.drafter_dtype
        self.dataset, self.eval_indices, self.layer_ids = dataset, eval_indices, layer_ids
        self.max_length, self.loss_chunk, self.seed = max_length, loss_chunk, seed
        # (teacher-forced tau, epoch) of the recent steps: an evaluation's training tau (d) is
        # the taus' mean
        self.recent_tau_tf: deque = deque(maxlen=cfg.train_tau_steps)
        self.agreement: tuple[int, int] | None = None  # (agree, total), at the first evaluation
        self.evaluated_step = -1  # the end of a run evaluates again only when it is a new step
        self.exact_head: bool | None = None  # the prompt sets' batched decoding (_exact_head)

    def due(self, step: int) -> bool:
        """A periodic evaluation is due at this step."""
        return bool(self.cfg.every) and step % self.cfg.every == 0

    def stepped(self, tau_tf: float, epoch: int = 0) -> None:
        """A training step's teacher-forced tau and the epoch of its batch."""
        self.recent_tau_tf.append((tau_tf, epoch))

    def train_tau(self) -> tuple[float, float]:
        """(d): (the mean of the recent steps' taus, published; the one eval.overfit_gap
        compares with (c): the same, or MISSING while every one of those steps was in the first
        epoch). A step's tau is taken before its update, so in the first epoch each sample is new
        to the drafter: (d) is then a held-out measure itself, and a gap to (c) is the mix of
        the few held-out samples (the demo's data: a third are runs of one byte, tau 4-8, the
        rest word loops near 1.2), never memorisation."""
        if not self.recent_tau_tf:
            return acceptance.MISSING, acceptance.MISSING
        train = float(np.mean([t for t, _ in self.recent_tau_tf]))
        seen = any(e >= 1 for _, e in self.recent_tau_tf)
        return train, (train if seen else acceptance.MISSING)

    def evaluate(self, step: int, drafter, target) -> float | None:
        """The held-out measures (``_heldout``), then exact tau on each prompt set. Returns the
        exact tau checkpoints/best follows: the held-out one, or eval.best_set's (None: nothing
        to evaluate, or this step was)."""
        if self.evaluated_step == step:  # the last periodic evaluation was this step
            return None
        # the drafter as it is served (eval.drafter_dtype): a cast copy, freed on return
        if parameter_dtype(drafter) != getattr(torch, self.dtype):
            drafter = served_copy(drafter, self.dtype)
        taus = {}
        buckets = buckets_of(target)  # acceptance by context length, by the target's window
        if len(self.eval_indices):
            taus[""] = self._heldout(step, drafter, target, buckets)
        if self.sets:
            exact_head = self._exact_head(target)
            with evaluation_attention(drafter):
                for s in self.sets:  # after the held-out line: its findings come first
                    res = evaluate_set(s, step, target, drafter, self.layer_ids,
                                       batch=self.cfg.set_batch, cache=self.cfg.cache,
                                       exact_head=exact_head, buckets=buckets)
                    self.publish(replace(res, drafter_dtype=self.dtype))
                    taus[s.name] = res.tau
        if taus:
            self.evaluated_step = step
        return taus.get(self.cfg.best_set)

    def _exact_head(self, target) -> bool:
        """Whether the batched decoding may take logits as lm_head of the last hidden state at
        the fed positions only (target_decoding.head_is_lm_head), asked once; the cache path reads
        the model's own logits."""
        if self.exact_head is None:
            probe = list(self.sets[0].prompt_ids[0])[:64]
            self.exact_head = self.cfg.cache or head_is_lm_head(target, probe, [0])
        return self.exact_head

    def _heldout(self, step: int, drafter, target, buckets) -> float:
        """The measures of acceptance: exact tau on the held-out prompts, teacher-forced tau on
        the target's own decoding of them and on the held-out samples, the training tau of the
        recent steps, and at the first evaluation the data/target agreement; then each finding's
        message. Returns the exact tau."""
        cfg = self.cfg
        t0 = time.monotonic()
        prompts = eval_prompts(self.dataset, self.eval_indices, cfg.prompt_tokens)
        # (c) scores as many response tokens as (a) decodes, on the data's own labels
        heldout = heldout_samples(self.dataset, self.eval_indices, cfg.prompt_tokens,
                                  cfg.max_new_tokens, self.max_length)
        measured = self._measure(drafter, target, prompts, heldout)
        res, (tf_target, n_target), (tf_all, n_all), (tf_heldout, n_heldout) = measured
        if self.agreement is None and cfg.agreement_samples:
            self.agreement = self._agreement(target)
        agree, total = self.agreement or (0, 0)
        share = agree / total if total else acceptance.MISSING
        train, train_rule = self.train_tau()
        miss = acceptance.MISSING
        tf_target = tf_target if n_target else miss
        tf_all = tf_all if n_all else miss
        tf_heldout = tf_heldout if n_heldout else miss
        found = acceptance.findings(step, res.tau, tf_target, tf_heldout, train_rule, share,
                                    cfg, target_all=tf_all, provenance=self.provenance)
        # A confidence head (DSpark): its calibration on the rounds just decoded
        cal = calibrate(res.confidences, res.accepted) if res.confidences else None
        self.publish(EvalResult(
            step=step, tau=res.tau, acceptance=list(res.acceptance), prompts=len(prompts),
            **acceptance.serving_fields(res.acceptance, res.proposed), drafter_dtype=self.dtype,
            tau_tf_target=tf_target, tau_tf_target_all=tf_all, tau_tf_heldout=tf_heldout,
            tau_tf_train=train, agreement=share, agreement_positions=total,
            findings=[f.kind for f in found], seconds=time.monotonic() - t0,
            calibration=cal.as_dict() if cal is not None else {},
            tau_unary=self._unary_tau(drafter, target, prompts),
            context=res.by_context(buckets)))
        for f in found:
            self.publish(Log(level=f.level, source="eval", message=f.message))
        return res.tau

    def _unary_tau(self, drafter, target, prompts) -> float:
        """Exact tau of the prompts with the drafter's unary argmax in place of its own path
        (a drafter with ``unary_path``: DFlash2's selector); MISSING for the others."""
        path = getattr(drafter, "unary_path", None)
        if path is None:
            return acceptance.MISSING
        with evaluation_attention(drafter), path():
            return evaluate_tau(target_fn_for(target, self.layer_ids, cache=self.cfg.cache),
                                drafter, prompts, self.cfg.max_new_tokens, self.layer_ids).tau

    def _measure(self, drafter, target, prompts, heldout) -> tuple:
        """(exact decoding, and (tau, positions) of the three teacher-forced measures) with the
        drafter in eval mode and the evaluation's attention (``evaluation_attention``)."""
        cfg, layer_ids = self.cfg, self.layer_ids
        with evaluation_attention(drafter):
            res = evaluate_tau(target_fn_for(target, layer_ids, cache=cfg.cache),
                               drafter, prompts, cfg.max_new_tokens, layer_ids)
            decoded = [(p + out, [0] * len(p) + [1] * len(out))
                       for p, out in zip(prompts, res.outputs)]
            feats = features_fn_for(target, layer_ids)
            chunk = self.loss_chunk
            # (b) at the anchors decoding used, to compare with (a); at every position, to
            # compare with (c), which has no decoding anchors
            return (res, teacher_forced_eval(feats, drafter, decoded, chunk, anchors=res.anchors),
                    teacher_forced_eval(feats, drafter, decoded, chunk),
                    teacher_forced_eval(feats, drafter, heldout, chunk))

    def _agreement(self, target_model) -> tuple[int, int]:
        """(agree, total) on ``eval.agreement_samples`` training samples spread over the data
        set (never the held-out ones), each cut to data.max_length as training cuts it."""
        cfg, dataset = self.cfg, self.dataset
        train = np.setdiff1d(np.arange(len(dataset)), self.eval_indices)
        if not len(train):
            return 0, 0
        k = min(cfg.agreement_samples, len(train))
        picks = np.unique(train[np.linspace(0, len(train) - 1, k).round().astype(int)])
        rows = [dataset.get(int(i)) for i in picks]
        L = self.max_length
        return label_agreement(target_model, [r[0][:L] for r in rows], [r[1][:L] for r in rows],
                               max_positions=cfg.agreement_positions, seed=self.seed)


def _prompt_cut(ids, mask, prompt_tokens: int) -> int:
    """Where a held-out sample's prompt ends: at a turn boundary of the data (where a trained
    span begins, the end of a generation prompt), the last one within ``prompt_tokens``, else
    the first; at ``prompt_tokens`` only when the sample has none (trained from 0, or not at
    all). A prompt cut inside a turn would have the target continue the user's text, not answer
    it, and (b) would then score other text than the data's answers."""
    m = np.asarray(mask) > 0
    starts = np.flatnonzero(m[1:] & ~m[:-1]) + 1
    if not len(starts):
        return min(len(ids) - 1, prompt_tokens)
    within = starts[starts <= prompt_tokens]
    return int(within[-1] if len(within) else starts[0])


def eval_prompts(dataset, indices, prompt_tokens: int) -> list[list[int]]:
    """The prompts of exact tau: each held-out sample cut at a turn boundary (``_prompt_cut``:
    within ``prompt_tokens`` when the sample has one there, else at its first), or to
    ``prompt_tokens`` when it has none."""
    prompts = []
    for i in indices:
        ids, mask = dataset.get(int(i))
        prompts.append([int(x) for x in ids[: _prompt_cut(ids, mask, prompt_tokens)]])
    return prompts


def heldout_samples(dataset, indices, prompt_tokens: int, new_tokens: int, max_length: int):
    """(input_ids, loss_mask) of each held-out sample up to ``new_tokens`` past its prompt's end
    (and at most ``max_length``, as training cuts it): what (c) scores on the data's labels."""
    out = []
    for i in indices:
        ids, mask = dataset.get(int(i))
        end = min(len(ids), _prompt_cut(ids, mask, prompt_tokens) + new_tokens, max_length)
        out.append((ids[:end], mask[:end]))
    return out
