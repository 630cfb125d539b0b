"""One drafter optimizer step, on one or several drafter devices (data parallel).

Every replica backpropagates the UN-normalised weighted loss sum of its samples; at the step, the
gradients of all replicas are summed and divided by the total weight in use. So N replicas on
disjoint samples give exactly the gradient one drafter would compute on their union, and every
replica then applies the same AdamW update (same init, same gradients: the weights stay equal).
"""

from __future__ import annotations

import copy
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from . import objective as obj
from .config import Config, default_gamma
from .drafter import DFlashDrafter, build_drafter_config

# On GPU the anchor count of a batch is rounded up to a multiple of this, so compiled
# FlexAttention and its block mask see a handful of shapes instead of one per batch.
ANCHOR_PAD = 64


class StepInterrupted(Exception):
    """The stop event was set between micro-groups of a drafter step."""


class NonFiniteLoss(ArithmeticError):
    """The step's loss or gradient norm is NaN or infinite: no optimizer step is taken, so the
    weights (and every checkpoint) stay as they were after the last good step."""

    error_kind = "data"

    def __init__(self, step: int, what: str, value: float, sample_ids: list[int]):
        shown = ", ".join(map(str, sample_ids[:32])) + (" ..." if len(sample_ids) > 32 else "")
        super().__init__(f"{what} is {value} at step {step}; the step's samples (data indices): "
                         f"{shown}")
        self.step, self.sample_ids = step, sample_ids
        self.hint = ("the weights were not updated and the last checkpoint stands; check those "
                     "samples (empty or out-of-vocabulary responses?), or lower optim.lr, then "
                     "restart (r) to resume from the last checkpoint")


@dataclass
class Micro:
    """What one replica accumulated since the last optimizer step."""

    loss_sum: float = 0.0
    weight_sum: float = 0.0
    tau_sum: float = 0.0
    blocks: int = 0
    tokens: int = 0
    samples: int = 0
    padded: int = 0

    def add(self, other: "Micro") -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, getattr(self, f) + getattr(other, f))


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tau_tf: float
    tokens: int
    samples: int
    padding_frac: float
    extra: dict = field(default_factory=dict)


class DrafterReplica:
    """A drafter copy on one device with its optimizer."""

    def __init__(self, drafter: DFlashDrafter, device: torch.device, cfg: Config,
                 embed: nn.Embedding, lm_head: nn.Linear):
        self.device = torch.device(device)
        self.cfg = cfg
        self.drafter = drafter.to(self.device, dtype=torch.float32)
        self.drafter.attach_target_head(embed.to(self.device), lm_head.to(self.device))
        self.drafter.train()
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=o.lr,
                                           betas=tuple(o.betas), weight_decay=o.weight_decay)
        self.gamma = cfg.drafter.gamma or default_gamma(self.drafter.block_size)
        self.autocast = (self.device.type == "cuda" and cfg.drafter.dtype == "bfloat16")
        self.micro = Micro()
        self.sample_ids: list[int] = []  # data indices accumulated since the last step
        # Block tokens live at once in a step; halved by back_off() after an out-of-memory error.
        self.micro_block_tokens = cfg.drafter.micro_block_tokens
        self.last_rows = 0  # sequences in the last batch
        self.last_block_tokens = 0  # block tokens per sequence (anchors x block size) in it

    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.drafter.parameters() if p.requires_grad]

    def accumulate(self, batch, features: torch.Tensor, seed: int,
                   stop: threading.Event | None = None,
                   beat: Callable[[], None] | None = None) -> Micro:
        """Forward + backward of one batch (split into sequence groups so at most
        drafter.micro_block_tokens block tokens are live); gradients accumulate in .grad.

        With ``stop``, raises StepInterrupted before the next group once it is set (a 27B-shaped
        batch of 57 samples is ~20 s of work; an abort waits for one group). The partial
        gradients are then meaningless: the caller must not step on them."""
        d = self.drafter
        B = d.block_size
        masks = [batch.loss_mask[r, : int(batch.lengths[r])].numpy() for r in range(len(batch.lengths))]
        anchors = obj.batch_anchors(masks, self.cfg.drafter.num_anchors, seed, batch.epoch,
                                    [int(i) for i in batch.indices],
                                    pad_to=ANCHOR_PAD if self.device.type == "cuda" else 1)
        n, A = anchors.shape
        group = obj.sequences_per_group(self.micro_block_tokens, A * B)
        self.last_rows, self.last_block_tokens = n, A * B
        ids_all = batch.input_ids.to(self.device, non_blocking=True)
        mask_all = batch.loss_mask.to(self.device, non_blocking=True)
        anchors = anchors.to(self.device)
        out = Micro(tokens=int(batch.num_tokens), samples=n, padded=int(batch.padded_tokens))
        self.sample_ids.extend(int(i) for i in batch.indices)
        for s in range(0, n, group):
            if stop is not None and stop.is_set():
                raise StepInterrupted
            if beat is not None:
                beat()  # a micro-group is progress the stall watchdog can see
            rows = slice(s, s + group)
            a = anchors[rows]
            ids, pos = d.block_inputs(ids_all[rows], a)
            labels = obj.block_labels(ids_all[rows], mask_all[rows], a, B)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                # One group's features at a time: a 27B batch's are ~3 GiB on the drafter GPU.
                feats = features[rows].to(self.device, non_blocking=True)
                hidden = d(feats, d.embed_tokens(ids).float(), pos, a)
            lo = obj.chunked_loss(hidden, labels, d.lm_head.weight, self.gamma,
                                  self.cfg.drafter.loss_chunk)
            if lo.weight_sum > 0:
                (lo.loss * lo.weight_sum).backward()
            out.loss_sum += float(lo.loss.detach()) * lo.weight_sum
            out.weight_sum += lo.weight_sum
            out.tau_sum += lo.tau_tf * lo.blocks
            out.blocks += lo.blocks
        self.micro.add(out)
        return out


    def discard_step(self) -> None:
        """Forget what this replica accumulated since the last optimizer step (its gradients and
        counts), so the step's batches can be trained again from scratch."""
        self.optimizer.zero_grad(set_to_none=True)
        self.micro = Micro()
        self.sample_ids = []

    def back_off(self) -> tuple[int, int] | None:
        """After an out-of-memory error: halve the micro-group (the sequences of the last batch
        whose blocks live at once) by lowering micro_block_tokens. Returns (old, new), or None when a group is already one sequence (no
        smaller size exists)."""
        per_seq = self.last_block_tokens
        group = min(self.micro_block_tokens // per_seq, self.last_rows) if per_seq else 0
        if group <= 1:
            return None
        old = self.micro_block_tokens
        self.micro_block_tokens = (group // 2) * per_seq
        return old, self.micro_block_tokens


def reduce_and_step(replicas: list[DrafterReplica], step: int, total_steps: int) -> StepResult:
    """Average gradients over replicas by total weight, clip, and step every optimizer."""
    cfg = replicas[0].cfg
    weight = sum(r.micro.weight_sum for r in replicas)
    loss = sum(r.micro.loss_sum for r in replicas) / max(weight, 1e-12)
    ids = [i for r in replicas for i in r.sample_ids]
    if not math.isfinite(loss):
        raise NonFiniteLoss(step + 1, "the loss", loss, ids)
    lead = replicas[0]
    lead_params = lead.params()
    scale = 1.0 / weight if weight > 0 else 0.0
    with torch.no_grad():
        for i, p in enumerate(lead_params):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            for r in replicas[1:]:
                q = r.params()[i]
                if q.grad is not None:
                    g = g + q.grad.to(g.device)
            p.grad = g * scale
        grad_norm = float(torch.nn.utils.clip_grad_norm_(lead_params, cfg.optim.grad_clip))
        if not math.isfinite(grad_norm):  # one sync per step, which the clip needs anyway
            raise NonFiniteLoss(step + 1, "the gradient norm", grad_norm, ids)
        for r in replicas[1:]:
            for p, q in zip(lead_params, r.params()):
                q.grad = p.grad.to(q.device, non_blocking=True)
    lr = obj.lr_at(step, total_steps, cfg.optim.lr, cfg.optim.warmup_frac, cfg.optim.min_lr_frac)
    for r in replicas:
        for g in r.optimizer.param_groups:
            g["lr"] = lr
        r.optimizer.step()
        r.optimizer.zero_grad(set_to_none=True)
    m = Micro()
    for r in replicas:
        m.add(r.micro)
        r.micro = Micro()
        r.sample_ids = []
    return StepResult(
        step=step + 1, loss=m.loss_sum / max(m.weight_sum, 1e-12), lr=lr, grad_norm=grad_norm,
        tau_tf=m.tau_sum / max(m.blocks, 1), tokens=m.tokens, samples=m.samples,
        padding_frac=m.padded and (m.padded - m.tokens) / m.padded,
    )


class StepBarrier:
    """Lets drafter threads meet at each optimizer step; the last one to arrive runs the reduce.
    Waits in short slices so an abort (``stop`` set) releases everyone within a fraction of a
    second instead of leaving threads blocked."""

    def __init__(self, parties: int, stop: threading.Event):
        self.parties = parties
        self.stop = stop
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self.result = None

    def arrive(self, action) -> bool:
        """Returns True once the step is done, False if stopped while waiting."""
        with self._cond:
            gen = self._generation
            self._arrived += 1
            if self._arrived == self.parties:
                self.result = action()
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
                return True
            while gen == self._generation:
                if self.stop.is_set():
                    return False
                self._cond.wait(0.1)
            return True


def build_replicas(cfg: Config, target, devices: list[torch.device], *, layer_ids: list[int],
                   mask_id: int, resume=None) -> list[DrafterReplica]:
    """The drafter (from a checkpoint to resume, ``drafter.init_from``, or fresh from the target's
    shape) and one replica of it per drafter device, each with the target's frozen embedding and
    head. ``target``: a loaded TargetModel; ``resume``: a checkpoint's ResumeState or None."""
    if resume is not None:
        drafter = DFlashDrafter(DFlashDrafter.config_from_dict(resume.drafter_config))
        drafter.load_state_dict(resume.drafter_state)
    elif cfg.drafter.init_from:
        drafter = DFlashDrafter.load(cfg.drafter.init_from)
    else:
        d = cfg.drafter
        dcfg = build_drafter_config(
            target.model.config, num_layers=d.num_layers, target_layer_ids=layer_ids,
            block_size=d.block_size, mask_token_id=mask_id, hidden_size=d.hidden_size,
            intermediate_size=d.intermediate_size, num_attention_heads=d.num_attention_heads,
            num_key_value_heads=d.num_key_value_heads)
        torch.manual_seed(cfg.run.seed)
        drafter = DFlashDrafter(dcfg)
    embed = nn.Embedding.from_pretrained(target.embed_tokens.weight.detach().clone(), freeze=True)
    head = nn.Linear(target.hidden_size, target.vocab_size, bias=False)
    head.weight = nn.Parameter(target.lm_head.weight.detach().clone(), requires_grad=False)
    if devices[0].type == "cpu":
        embed, head = embed.float(), head.float()
    reps = make_replicas(drafter, devices, cfg, embed, head)
    if resume is not None:
        for r in reps:
            r.optimizer.load_state_dict(resume.optimizer_state)
    return reps


def make_replicas(drafter: DFlashDrafter, devices: list[torch.device], cfg: Config,
                  embed: nn.Embedding, lm_head: nn.Linear) -> list[DrafterReplica]:
    reps = []
    for i, dev in enumerate(devices):
        d = drafter if i == 0 else copy.deepcopy(drafter)
        # Each replica gets its own copy of the frozen head on its own device.
        e, h = (embed, lm_head) if i == 0 else (copy.deepcopy(embed), copy.deepcopy(lm_head))
        reps.append(DrafterReplica(d, dev, cfg, e, h))
    return reps


def total_steps_for(cfg: Config, batches_per_epoch: int, world: int) -> int:
    per_step = max(1, cfg.optim.grad_accum * world)
    steps = math.ceil(batches_per_epoch * cfg.optim.epochs / per_step)
    return min(steps, cfg.run.max_steps) if cfg.run.max_steps else steps


class RateMeter:
    """Tokens and samples per second over a sliding window of recent steps."""

    def __init__(self, window_s: float = 20.0):
        self.window = window_s
        self.points: list[tuple[float, int, int]] = []

    def add(self, tokens: int, samples: int) -> tuple[float, float]:
        now = time.monotonic()
        self.points.append((now, tokens, samples))
        while len(self.points) > 2 and now - self.points[0][0] > self.window:
            self.points.pop(0)
        if len(self.points) < 2:
            return 0.0, 0.0
        dt = now - self.points[0][0]
        toks = sum(p[1] for p in self.points[1:])
        samp = sum(p[2] for p in self.points[1:])
        return toks / dt, samp / dt
