"""One drafter replica: a drafter copy on one device, its optimizer, and its part of a step.

A replica makes (or takes from the loader) its batch's anchors and block labels, runs forward and
backward in micro-groups so that at most drafter.micro_block_tokens block tokens are live, and
accumulates the un-normalised weighted loss sum into one flat float32 buffer that its gradients
are views of, with the step's statistics behind them. Summing the replicas and stepping them is
trainer.py, which reads only that buffer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from dflash_core.anchor_counts import ANCHOR_PAD, pass_anchors
from dflash_core.models import objective as obj
from dflash_core.models.training.optimizers import build_optimizer
from dflash_core.config import DrafterConfig, OptimConfig
from dflash_core.levers import halve
from dflash_core.models.dflash.drafter import DFlashDrafter
from dflash_core.models.training.handoff import FeatureCopier

__all__ = ["ANCHOR_PAD", "DrafterReplica", "Micro", "STATS", "StepInterrupted", "prepare_batch"]


class StepInterrupted(Exception):
    """The stop event was set between micro-groups of a drafter step."""


@dataclass
class Micro:
    """What one replica accumulated since the last optimizer step. The loss and tau sums stay on
    the replica's device (tensors) until the step reads them, once, with everything else."""

    loss_sum: torch.Tensor | float = 0.0
    weight_sum: torch.Tensor | float = 0.0  # a tensor when D-PACE made the weights on the GPU
    tau_sum: torch.Tensor | float = 0.0
    blocks: int = 0
    tokens: int = 0
    samples: int = 0
    padded: int = 0
    terms: torch.Tensor | float = 0.0  # weighted sums of the family's loss terms (step_stats)

    def add(self, other: "Micro") -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, getattr(self, f) + getattr(other, f))


# The step's statistics ride behind the gradient in each replica's flat buffer, so one reduction
# (within the node, then across nodes) sums both.
STATS = ("weight", "loss", "tau", "blocks", "tokens", "samples", "padded")
# A family's loss terms (drafter.step_stats; DSpark's CE, TV and BCE) ride behind those
# (trainer.StepResult.extra).


def prepare_batch(batch, num_anchors: int, block_size: int, seed: int, pad_to: int = 1,
                  per_1k: float = 0.0):
    """The batch with its drafter anchors and block labels, made on the host (the loader thread
    calls this, so the drafter's step finds them ready). Anchors depend only on (seed, epoch,
    sample): the same whichever thread or drafter makes them. ``per_1k``:
    drafter.anchors_per_1k_tokens (0: up to ``num_anchors`` each)."""
    masks = [batch.loss_mask[r, : int(batch.lengths[r])].numpy() for r in range(len(batch))]
    anchors = obj.batch_anchors(masks, num_anchors, seed, batch.epoch,
                                [int(i) for i in batch.indices], pad_to=pad_to, per_1k=per_1k)
    labels = obj.block_labels(batch.input_ids, batch.loss_mask, anchors, block_size)
    return replace(batch, anchors=anchors, labels=labels)


class DrafterReplica:
    """A drafter copy on one device with its optimizer. Its gradients are views into one flat
    float32 buffer (followed by the step's statistics), so reducing a step is one collective.

    The drafter's family makes the loss of each micro-group (drafter.step_loss; ``settings``:
    the family's from the config, None for its defaults): DSpark's features, for one, carry one
    more H-vector per token, last (drafter.feature_vectors).

    ``dcfg`` and ``optim``: the config's drafter and optim sections (a replica reads no other)."""

    def __init__(self, drafter: DFlashDrafter, device: torch.device, dcfg: DrafterConfig,
                 optim: OptimConfig, embed: nn.Embedding, lm_head: nn.Linear,
                 settings=None):
        self.device = torch.device(device)
        self.dcfg, self.optim = dcfg, optim
        self.loss = drafter.step_loss(dcfg, settings)
        self.settings = self.loss.settings
        self.stats = STATS + self.loss.stats
        self.drafter = drafter.to(self.device, dtype=torch.float32)
        self.drafter.attach_target_head(embed.to(self.device), lm_head.to(self.device))
        self.drafter.train()
        params = self.params()
        self.grad_numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(self.grad_numel + len(self.stats), dtype=torch.float32,
                                device=self.device)
        offset = 0
        for p in params:
            # Backward adds into an existing .grad in place, so the views stay views.
            p.grad = self.flat[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self.optimizer = build_optimizer(self.drafter, params, optim, self.device)
        self.autocast = (self.device.type == "cuda" and dcfg.dtype == "bfloat16")
        # drafter.recompute: "auto" reaches here off unless preflight's plan turned it on;
        # back_off() may turn it on after running out of memory at the smallest pass.
        self.drafter.recompute = dcfg.recompute == "on"
        self.pad = ANCHOR_PAD if self.device.type == "cuda" else 1
        self.copier = FeatureCopier(self.device)
        self.micro = Micro()
        self.sample_ids: list[int] = []  # data indices accumulated since the last step
        # Block tokens live at once in a step; halved by back_off() after an out-of-memory error.
        self.micro_block_tokens = dcfg.micro_block_tokens
        self.last_rows = 0  # sequences in the last batch
        self.last_block_tokens = 0  # block tokens per sequence (anchors x block size) in it

    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.drafter.parameters() if p.requires_grad]

    @property
    def grads(self) -> torch.Tensor:
        return self.flat[: self.grad_numel]

    def accumulate(self, batch, features: torch.Tensor, seed: int,
                   stop: threading.Event | None = None,
                   beat: Callable[[], None] | None = None,
                   ready: torch.cuda.Event | None = None) -> Micro:
        """Forward + backward of one batch (split into sequence groups so at most
        drafter.micro_block_tokens block tokens are live); gradients accumulate in .grad.
        ``features`` may live on another GPU (the target's); ``ready`` is the event the target
        recorded when they were done. Nothing here waits for the GPU: losses stay on it.

        With ``stop``, raises StepInterrupted before the next group once it is set (a 27B-shaped
        batch of 57 samples is ~20 s of work; an abort waits for one group). The partial
        gradients are then meaningless: the caller must not step on them."""
        d = self.drafter
        B = d.block_size
        if batch.labels is None or batch.labels.shape[-1] != d.label_width:
            batch = prepare_batch(batch, self.dcfg.num_anchors, d.label_width, seed,
                                  pad_to=self.pad, per_1k=self.dcfg.anchors_per_1k_tokens)
        loss = self.loss
        loss.check_features(d, features)
        terms = torch.zeros(len(loss.stats), device=self.device) if loss.stats else None
        n, A = batch.anchors.shape
        group = obj.sequences_per_group(self.micro_block_tokens, A * B)
        # A sequence with more blocks than a pass holds goes in several passes of fewer anchors.
        cols = pass_anchors(self.micro_block_tokens, A, B, self.pad)
        self.last_rows, self.last_block_tokens = n, A * B
        ids_all = batch.input_ids.to(self.device, non_blocking=True)
        anchors = batch.anchors.to(self.device, non_blocking=True)
        out = Micro(tokens=int(batch.num_tokens), samples=n, padded=int(batch.padded_tokens))
        self.sample_ids.extend(int(i) for i in batch.indices)
        loss_sum = torch.zeros((), device=self.device)
        tau_sum = torch.zeros((), device=self.device)
        starts = list(range(0, n, group))
        # One group's features are copied ahead while the group before it computes.
        nxt = self.copier.start(features[starts[0]: starts[0] + group], ready)
        for i, s in enumerate(starts):
            if stop is not None and stop.is_set():
                raise StepInterrupted
            if beat is not None:
                beat()  # a micro-group is progress the stall watchdog can see
            rows = slice(s, s + group)
            feats = nxt.take()
            if i + 1 < len(starts):
                nxt = self.copier.start(features[starts[i + 1]: starts[i + 1] + group], ready)
            for c in range(0, A, cols):
                part = slice(c, c + cols)
                host_anchors = batch.anchors[rows, part]
                if c and not bool((host_anchors >= 0).any()):
                    continue  # padding anchors only: nothing to learn in this pass
                a = anchors[rows, part]
                inputs, t = loss.targets(d, feats, batch.labels[rows, part],
                                         batch.input_ids[rows], host_anchors)
                labels = t.labels.to(self.device, non_blocking=True)
                ids, pos = d.block_inputs(ids_all[rows], a)
                with torch.autocast(self.device.type, dtype=torch.bfloat16,
                                    enabled=self.autocast):
                    hidden = d(inputs, d.embed_tokens(ids).float(), pos, a)
                lo = loss(d, hidden, pos, labels, t)
                if terms is not None:
                    terms += lo.terms
                if len(t.picked.rows):  # the weights of labelled slots are > 0 under either loss
                    (lo.loss * lo.weight_sum).backward()
                loss_sum += lo.loss.detach() * lo.weight_sum
                tau_sum += lo.tau_sum
                out.weight_sum += lo.weight_sum
                out.blocks += lo.blocks
                del inputs, hidden, lo, t
            del feats
        out.loss_sum, out.tau_sum = loss_sum, tau_sum
        if terms is not None:
            out.terms = terms
        self.micro.add(out)
        return out

    def discard_step(self) -> None:
        """Forget what this replica accumulated since the last optimizer step (its gradients and
        counts), so the step's batches can be trained again from scratch."""
        self.flat.zero_()
        self.micro = Micro()
        self.sample_ids = []

    def back_off(self) -> str | None:
        """After an out-of-memory error: halve the pass (the sequences of the last batch whose
        blocks live at once, then a sequence's anchors per pass) by lowering
        micro_block_tokens; at the smallest pass, with drafter.recompute auto, recompute the
        layers in backward. Returns what changed, in words, or None when nothing smaller
        exists."""
        per_seq = self.last_block_tokens
        old = self.micro_block_tokens
        group = min(old // per_seq, self.last_rows) if per_seq else 0
        B = self.drafter.block_size
        if group > 1:
            self.micro_block_tokens = halve(group, 1) * per_seq  # the levers' one rule
            return f"micro_block_tokens {old}, now {self.micro_block_tokens}"
        cols = pass_anchors(old, per_seq // B, B, self.pad) if per_seq else 0
        fewer = halve(cols, self.pad)
        if fewer is not None and fewer < cols:
            self.micro_block_tokens = fewer * B
            n = pass_anchors(fewer * B, per_seq // B, B, self.pad)
            return (f"micro_block_tokens {old}, now {self.micro_block_tokens} "
                    f"({n} anchor{'s' if n > 1 else ''} a pass)")
        if self.dcfg.recompute == "auto" and not self.drafter.recompute:
            self.drafter.recompute = True
            return (f"micro_block_tokens {old} (its smallest pass), now with the drafter's "
                    "layers recomputed in backward (drafter.recompute auto)")
        return None

    def write_stats(self) -> None:
        """The accumulated statistics into the tail of the flat buffer, behind the gradient."""
        m = self.micro
        tail = self.flat[self.grad_numel:]
        extra = [0.0] * (len(self.stats) - len(STATS))
        tail.copy_(torch.tensor([0.0, 0.0, 0.0, m.blocks, m.tokens, m.samples, m.padded, *extra],
                                dtype=torch.float32), non_blocking=True)
        for i, v in ((0, m.weight_sum), (1, m.loss_sum), (2, m.tau_sum)):
            if torch.is_tensor(v):
                tail[i] += v.to(self.device)
            else:
                tail[i] += float(v)
        if extra and torch.is_tensor(m.terms):
            tail[len(STATS):] += m.terms.to(self.device, torch.float32)

