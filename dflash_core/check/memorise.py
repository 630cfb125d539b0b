"""Train the configured drafter on the check's samples until it has memorised them.

The engine's own pieces do the work: the samples go through ``data`` (shards, collate), the
target's ``features``, ``trainer.build_replicas`` (one replica per drafter GPU of the layout) and
``trainer.reduce_and_step``, so what is checked is what a run trains with. The target is frozen,
so the features are computed once. Every valid position is an anchor (the check must decode from
any of them), redrawn each step as a new epoch. With drafter.objective dspark the drafter is
DSpark's, its features carry the target's post-norm last hidden state and its labels are one slot
wider (its anchor slot predicts: the ceiling is B+1). How much is memorised enough, and with
which of its settings, the family says (Family.memorise): DSpark memorises with cross-entropy
leading (families/dspark.py, CHECK_WEIGHTS).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from dflash_core.config import Config
from dflash_core.data import ShardedDataset, collate, write_shards
from dflash_core.models import objective as obj
from dflash_core.eval.evaluate import evaluation_attention, teacher_forced_eval
from dflash_core.families.base import Memorise
from dflash_core.families.registry import family_of
from dflash_core.models.training.replica import ANCHOR_PAD, DrafterReplica, prepare_batch
from dflash_core.models.training.trainer import build_replicas, reduce_and_step
from dflash_core.check.samples import CheckSample

PROGRESS_EVERY_S = 5.0


@dataclass
class Memorised:
    replicas: list[DrafterReplica]
    batch: object  # the collated samples (data.Batch), anchors not drawn
    features: torch.Tensor  # the target's features of the batch, on the target's device (DSpark:
    # the post-norm last hidden state last, ``context`` without it)
    steps: int
    tau_tf: float  # teacher-forced tau of the last step, on the samples
    tau_ceiling: float  # what a perfect drafter reaches on them (short blocks at the end)
    loss: float
    seconds: float
    reached: bool  # tau_tf reached the family's share of the ceiling within the step cap
    history: list[tuple[int, float, float]] = field(default_factory=list)  # (step, loss, tau)
    terms: Memorise = Memorise()  # the family's memorise terms (families/base.Memorise)

    @property
    def drafter(self):
        return self.replicas[0].drafter

    @property
    def context(self) -> torch.Tensor:
        """The layer features the drafter's fc reads (what decoding gives it)."""
        d = self.drafter
        return self.features[..., : len(d.target_layer_ids) * d.config.hidden_size]


def tau_ceiling(labels: torch.Tensor) -> float:
    """Teacher-forced tau of a perfect predictor: per block, 1 + its labelled slots (they are a
    prefix of slots 1..W-1: labels stop at the end of the response). ``labels`` of the drafter's
    label width W: B for DFlash, B+1 for DSpark (whose ceiling is then B+1)."""
    lab = labels != obj.IGNORE
    has = lab[:, :, 1]
    if not bool(has.any()):
        return 0.0
    full = lab[:, :, 1:].long().cumprod(-1).sum(-1) + 1
    return float(full[has].float().mean())


def check_config(cfg: Config, longest_response: int) -> Config:
    """The run's config for the check: every valid position an anchor, and the drafter keys
    its family memorises with (Family.memorise)."""
    ccfg = copy.deepcopy(cfg)
    ccfg.drafter.num_anchors = max(cfg.drafter.num_anchors, longest_response)
    ccfg.drafter.anchors_per_1k_tokens = 0.0  # a count: all of them, not a density
    for key, value in family_of(cfg).memorise(cfg.drafter).keys.items():
        setattr(ccfg.drafter, key, value)
    return ccfg


def collate_samples(samples: list[CheckSample], folder: Path, max_length: int):
    """The samples written as shards (the data layout a run reads) and collated into one batch."""
    write_shards([{"input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in samples], folder,
                 overwrite=True)
    dataset = ShardedDataset.open(folder)
    return collate(dataset, list(range(len(samples))), max_length=max_length)


def memorise(cfg: Config, target, samples: list[CheckSample], drafter_devices, *,
             layer_ids: list[int], mask_id: int, folder: Path, max_steps: int,
             say: Callable[[str], None] = lambda _: None) -> Memorised:
    t0 = time.monotonic()
    ccfg = check_config(cfg, max(len(s.response) for s in samples))
    batch = collate_samples(samples, folder / "data", ccfg.data.max_length)
    family = family_of(ccfg)
    terms = family.memorise(cfg.drafter)
    if terms.why:
        say(terms.why)
    share, aim = terms.share, max(terms.aim, terms.share)
    features = target.features(batch.input_ids, batch.attention_mask, layer_ids,
                               with_last_hidden=family.last_hidden)
    replicas = build_replicas(ccfg.drafter, ccfg.optim, target, list(drafter_devices),
                              seed=ccfg.run.seed, layer_ids=layer_ids, mask_id=mask_id,
                              settings=family.settings(ccfg.drafter))
    B = replicas[0].drafter.label_width
    pad = ANCHOR_PAD if replicas[0].device.type == "cuda" else 1
    ceiling = tau_ceiling(prepare_batch(batch, ccfg.drafter.num_anchors, B, ccfg.run.seed).labels)
    feats = {r.device: features.to(r.device) for r in replicas}
    history: list[tuple[int, float, float]] = []
    last_say = time.monotonic()
    res = None
    reached_at = 0  # the step that first reached the share: then on toward ``aim``
    for step in range(max_steps):
        b = prepare_batch(replace(batch, epoch=step), ccfg.drafter.num_anchors, B,
                          ccfg.run.seed, pad_to=pad)
        # Every replica trains the same batch: the reduced gradient is that batch's, and the
        # data-parallel step of the layout's drafter GPUs is exercised as a run would.
        for r in replicas:
            r.accumulate(b, feats[r.device], ccfg.run.seed)
        res = reduce_and_step(replicas, step, max_steps)
        history.append((res.step, res.loss, res.tau_tf))
        tau = res.tau_tf
        if tau >= share * ceiling or reached_at:
            # The step's tau is of the weights before its update; what is judged is after it
            # (under DSpark's distribution-matching loss an update can still flip an argmax).
            tau = settled_tau(replicas[0].drafter, samples, features)
        memorised = tau >= share * ceiling
        reached_at = reached_at or (res.step if memorised else 0)
        # Memorised; past it, toward ``aim`` for as many steps again at most (a margin for
        # exact decoding, whose few rounds lose a whole block to one wrong slot).
        done = memorised and (tau >= aim * ceiling or res.step >= 2 * reached_at)
        if done or time.monotonic() - last_say >= PROGRESS_EVERY_S:
            last_say = time.monotonic()
            say(f"step {res.step}/{max_steps}: loss {res.loss:.3f}, teacher-forced tau "
                f"{tau:.2f} of {ceiling:.2f}")
        if done:
            break
    for r in replicas:
        r.drafter.eval()
    return Memorised(replicas, batch, features, res.step if res else 0,
                     tau if res else 0.0, ceiling, res.loss if res else float("nan"),
                     time.monotonic() - t0, bool(res and tau >= share * ceiling),
                     history, terms)


def settled_tau(drafter, samples: list[CheckSample], features: torch.Tensor) -> float:
    """Teacher-forced tau of the drafter as it is now on the samples, a block at every valid
    position (the anchors the check trains on), with the attention decoding uses."""
    k = len(drafter.target_layer_ids) * drafter.config.hidden_size
    total, blocks = 0.0, 0
    with evaluation_attention(drafter):
        for i, s in enumerate(samples):
            ctx = features[i: i + 1, : len(s.input_ids), :k]
            tau, n = teacher_forced_eval(lambda ids, ctx=ctx: ctx, drafter,
                                         [(s.input_ids, s.loss_mask)])
            total, blocks = total + tau * n, blocks + n
    drafter.train()
    return total / blocks if blocks else 0.0
