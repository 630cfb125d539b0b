"""One drafter optimizer step, on one or several drafter devices (data parallel).

Every replica backpropagates the UN-normalised weighted loss sum of its samples; at the step, the
gradients of all replicas are summed and divided by the total weight in use. So N replicas on
disjoint samples give exactly the gradient one drafter would compute on their union, and every
replica then applies the same optimizer update (optim.name; same init, same gradients, same
optimizer state: the weights stay equal).

The replica (one device's drafter, its forward and backward into a flat gradient buffer) is
replica.py; this module builds the replicas, sums their buffers and steps them.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash_core.models import objective as obj
from dflash_core.models.training.optimizers import set_lr
from dflash_core.config import DrafterConfig, OptimConfig
from dflash_core.models.dflash.drafter import DFlashDrafter
from dflash_core.models.registry import (
    drafter_from_config, init_from_refusal, load_drafter, new_drafter,
)
from dflash_core.models.training.replica import STATS, DrafterReplica, Micro


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


def _nccl(flats: list[torch.Tensor]):
    """torch.cuda.nccl when it can reduce these buffers (CUDA, one per GPU), else None."""
    if len(flats) < 2 or not all(f.is_cuda for f in flats):
        return None
    try:
        from torch.cuda import nccl
        return nccl if nccl.is_available(flats) else None
    except (ImportError, RuntimeError):
        return None


def sum_replicas(replicas: list[DrafterReplica], across=None) -> None:
    """Every replica's flat buffer becomes the sum over all replicas (and, with ``across``, over
    all nodes). Replicas on distinct GPUs reduce with NCCL, one collective per step; others (the
    CPU, tests) add up on the first replica and copy back."""
    flats = [r.flat for r in replicas]
    nccl = _nccl(flats)
    if nccl is not None and across is None:
        nccl.all_reduce(flats)
        return
    if nccl is not None:
        nccl.reduce(flats, root=0)
    else:
        for f in flats[1:]:
            flats[0] += f.to(flats[0].device)
    if across is not None:
        across.all_reduce_(flats[0])
    if nccl is not None:
        nccl.broadcast(flats, root=0)
    else:
        for f in flats[1:]:
            f.copy_(flats[0])


def reduce_and_step(replicas: list[DrafterReplica], step: int, total_steps: int,
                    across=None) -> StepResult:
    """Sum gradients and statistics over replicas (and nodes, through ``across``: an object whose
    ``all_reduce_(buf)`` sums a flat float32 tensor over nodes in place), divide by the total
    loss weight, clip, and step every optimizer. The step's only host synchronisation reads the
    statistics and the gradient norm together, before any weight changes."""
    optim = replicas[0].optim
    ids = [i for r in replicas for i in r.sample_ids]
    for r in replicas:
        r.write_stats()
    sum_replicas(replicas, across)
    lead = replicas[0]
    clip = optim.grad_clip
    coefs, norm = [], None
    for r in replicas:  # every replica holds the same sums: each scales its own, on its device
        tail = r.flat[r.grad_numel:]
        inv = torch.where(tail[0] > 0, 1.0 / tail[0].clamp(min=1e-12), 0.0)
        g_norm = torch.linalg.vector_norm(r.grads) * inv
        coef = inv * (torch.clamp(clip / (g_norm + 1e-6), max=1.0) if clip > 0 else 1.0)
        coefs.append(coef)
        if r is lead:
            norm = g_norm
    host = torch.cat([lead.flat[lead.grad_numel:], norm.view(1)]).tolist()
    stats = dict(zip(lead.stats, host))
    grad_norm = host[-1]
    loss = stats["loss"] / max(stats["weight"], 1e-12)
    if not math.isfinite(loss):
        raise NonFiniteLoss(step + 1, "the loss", loss, ids)
    if not math.isfinite(grad_norm):
        raise NonFiniteLoss(step + 1, "the gradient norm", grad_norm, ids)
    lr = obj.lr_at(step, total_steps, optim.lr, optim.warmup_frac, optim.min_lr_frac)
    with torch.no_grad():
        for r, coef in zip(replicas, coefs):
            r.grads.mul_(coef)
            set_lr(r.optimizer, optim, lr / optim.lr)
            r.optimizer.step()
            r.flat.zero_()
            r.micro = Micro()
            r.sample_ids = []
    tokens, padded = int(stats["tokens"]), int(stats["padded"])
    # The family's loss terms' weighted means (DSpark's "loss_ce", "loss_tv", "loss_conf")
    extra = {f"loss_{k}": stats[k] / max(stats["weight"], 1e-12)
             for k in lead.stats[len(STATS):]}
    return StepResult(
        step=step + 1, loss=loss, lr=lr, grad_norm=grad_norm,
        tau_tf=stats["tau"] / max(stats["blocks"], 1), tokens=tokens,
        samples=int(stats["samples"]), padding_frac=padded and (padded - tokens) / padded,
        extra=extra,
    )


def build_replicas(dcfg: DrafterConfig, optim: OptimConfig, target,
                   devices: list[torch.device], *, seed: int, layer_ids: list[int], mask_id: int,
                   resume=None, objective: str | None = None,
                   settings=None) -> list[DrafterReplica]:
    """The drafter (from a checkpoint to resume, ``drafter.init_from``, or fresh from the target's
    shape) and one replica of it per drafter device, each with the target's frozen embedding and
    head. ``dcfg``, ``optim``: the config's drafter and optim sections; ``seed``: run.seed (a
    fresh drafter's init). ``target``: a loaded TargetModel; ``resume``: a checkpoint's
    ResumeState or None; ``objective``: the family to train (default dcfg.objective);
    ``settings``: its settings from the config (families.registry.settings; None: the family's
    defaults). A checkpoint of another objective raises registry.ObjectiveMismatch; a
    drafter.init_from folder the loader refuses, a ConfigError naming that key."""
    objective = objective or dcfg.objective
    if resume is not None:
        drafter = drafter_from_config(resume.drafter_config, objective)
        # A checkpoint without master weights reads model.safetensors, which for DSpark also
        # holds the frozen copies of the target's embedding and lm_head (borrowed, not state).
        drafter.load_state_dict({k: v for k, v in resume.drafter_state.items()
                                 if k not in drafter.frozen_keys})
    elif dcfg.init_from:
        try:  # preflight checked the folder: one changed since is still the config's to fix
            drafter = load_drafter(dcfg.init_from, objective, settings)
        except (ValueError, OSError) as exc:
            raise init_from_refusal(dcfg.init_from, objective, exc) from exc
    else:
        d = dcfg
        torch.manual_seed(seed)
        drafter = new_drafter(
            objective, target.model.config, num_layers=d.num_layers, target_layer_ids=layer_ids,
            block_size=d.block_size, mask_token_id=mask_id, settings=settings,
            hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
            num_attention_heads=d.num_attention_heads, num_key_value_heads=d.num_key_value_heads)
    embed = nn.Embedding.from_pretrained(target.embed_tokens.weight.detach().clone(), freeze=True)
    head = nn.Linear(target.hidden_size, target.vocab_size, bias=False)
    head.weight = nn.Parameter(target.lm_head.weight.detach().clone(), requires_grad=False)
    if devices[0].type == "cpu":
        embed, head = embed.float(), head.float()
    reps = make_replicas(drafter, devices, dcfg, optim, embed, head, settings)
    if resume is not None:
        for r in reps:
            r.optimizer.load_state_dict(resume.optimizer_state)
    return reps


def make_replicas(drafter: DFlashDrafter, devices: list[torch.device], dcfg: DrafterConfig,
                  optim: OptimConfig, embed: nn.Embedding, lm_head: nn.Linear,
                  settings=None) -> list[DrafterReplica]:
    reps = []
    for i, dev in enumerate(devices):
        d = drafter if i == 0 else copy.deepcopy(drafter)
        # Each replica gets its own copy of the frozen head on its own device.
        e, h = (embed, lm_head) if i == 0 else (copy.deepcopy(embed), copy.deepcopy(lm_head))
        reps.append(DrafterReplica(d, dev, dcfg, optim, e, h, settings))
    return reps


def epoch_steps_for(optim: OptimConfig, batches_per_epoch: int, world: int) -> int:
    """The optimizer steps that optim.epochs of the data make on ``world`` drafters."""
    per_step = max(1, optim.grad_accum * world)
    return math.ceil(batches_per_epoch * optim.epochs / per_step)


def total_steps_for(optim: OptimConfig, max_steps: int, batches_per_epoch: int,
                    world: int) -> int:
    """The run's steps: those of optim.epochs, or run.max_steps when that is fewer (0: none)."""
    steps = epoch_steps_for(optim, batches_per_epoch, world)
    return min(steps, max_steps) if max_steps else steps


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
