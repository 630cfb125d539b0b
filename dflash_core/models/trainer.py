"""One drafter optimizer step, on one or several drafter devices (data parallel).

Every replica backpropagates the UN-normalised weighted loss sum of its samples; at the step, the
gradients of all replicas are summed and divided by the total weight in use. So N replicas on
disjoint samples give exactly the gradient one drafter would compute on their union, and every
replica then applies the same optimizer update (optim.name; same init, same gradients, same
optimizer state: the weights stay equal).
"""

from __future__ import annotations

import copy
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from dflash_core.models import dspark_format, dspark_loss
from dflash_core.models import objective as obj
from dflash_core.models.optimizers import build_optimizer, set_lr
from dflash_core.config import DrafterConfig, OptimConfig, default_gamma
from dflash_core.levers import halve
from dflash_core.models.drafter import DFlashDrafter
from dflash_core.models.drafter_kinds import drafter_from_config, load_drafter, new_drafter
from dflash_core.models.dspark import DSparkDrafter, DSparkSettings
from dflash_core.models.handoff import FeatureCopier

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
    """What one replica accumulated since the last optimizer step. The loss and tau sums stay on
    the replica's device (tensors) until the step reads them, once, with everything else."""

    loss_sum: torch.Tensor | float = 0.0
    weight_sum: torch.Tensor | float = 0.0  # a tensor when D-PACE made the weights on the GPU
    tau_sum: torch.Tensor | float = 0.0
    blocks: int = 0
    tokens: int = 0
    samples: int = 0
    padded: int = 0
    terms: torch.Tensor | float = 0.0  # DSpark: [3] weighted sums of its CE, TV and BCE terms

    def add(self, other: "Micro") -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, getattr(self, f) + getattr(other, f))


# The step's statistics ride behind the gradient in each replica's flat buffer, so one reduction
# (within the node, then across nodes) sums both.
STATS = ("weight", "loss", "tau", "blocks", "tokens", "samples", "padded")
# A DSpark replica's buffer carries its three loss terms behind those (StepResult.extra).
DSPARK_STATS = dspark_loss.TERMS


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


def prepare_batch(batch, num_anchors: int, block_size: int, seed: int, pad_to: int = 1):
    """The batch with its drafter anchors and block labels, made on the host (the loader thread
    calls this, so the drafter's step finds them ready). Anchors depend only on (seed, epoch,
    sample): the same whichever thread or drafter makes them."""
    masks = [batch.loss_mask[r, : int(batch.lengths[r])].numpy() for r in range(len(batch))]
    anchors = obj.batch_anchors(masks, num_anchors, seed, batch.epoch,
                                [int(i) for i in batch.indices], pad_to=pad_to)
    labels = obj.block_labels(batch.input_ids, batch.loss_mask, anchors, block_size)
    return replace(batch, anchors=anchors, labels=labels)


class DrafterReplica:
    """A drafter copy on one device with its optimizer. Its gradients are views into one flat
    float32 buffer (followed by the step's statistics), so reducing a step is one collective.

    A DSparkDrafter trains with DSpark's loss (``dspark``: its settings; default the reference's
    with the drafter's own block size and rank). Its features then carry one more H-vector per
    token, last: the target's post-norm last hidden state ([n, S, (k+1)*H]).

    ``dcfg`` and ``optim``: the config's drafter and optim sections (a replica reads no other)."""

    def __init__(self, drafter: DFlashDrafter, device: torch.device, dcfg: DrafterConfig,
                 optim: OptimConfig, embed: nn.Embedding, lm_head: nn.Linear,
                 dspark: DSparkSettings | None = None):
        self.device = torch.device(device)
        self.dcfg, self.optim = dcfg, optim
        self.dspark = _dspark_settings(drafter, dspark, dcfg)
        self.stats = STATS + DSPARK_STATS if self.dspark is not None else STATS
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
        self.gamma = dcfg.gamma or default_gamma(self.drafter.block_size)
        self.dpace_alpha = dcfg.dpace_alpha if dcfg.loss == "dpace" else None
        if self.dspark is not None:
            self.gamma, self.dpace_alpha = self.dspark.gamma, None
        self.autocast = (self.device.type == "cuda" and dcfg.dtype == "bfloat16")
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
                                  pad_to=ANCHOR_PAD if self.device.type == "cuda" else 1)
        dsp = self.dspark
        if dsp is not None:
            _check_dspark_features(d, features)
            terms = torch.zeros(len(DSPARK_STATS), device=self.device)
        n, A = batch.anchors.shape
        group = obj.sequences_per_group(self.micro_block_tokens, A * B)
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
            a = anchors[rows]
            labels_host = batch.labels[rows]
            if dsp is not None:
                H = d.config.hidden_size
                feats, last = feats[..., :-H], feats[..., -H:]
                labels_host, prev = dspark_loss.dspark_targets(
                    labels_host, dspark_loss.anchor_tokens(batch.input_ids[rows],
                                                           batch.anchors[rows]))
                picked = dspark_loss.label_rows(labels_host, self.gamma)
            else:
                picked = obj.label_rows(labels_host, self.gamma, self.dpace_alpha)
            labels = labels_host.to(self.device, non_blocking=True)
            ids, pos = d.block_inputs(ids_all[rows], a)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                hidden = d(feats, d.embed_tokens(ids).float(), pos, a)
            if dsp is not None:
                lo = dspark_loss.dspark_loss(
                    hidden, last, pos, labels, prev.to(self.device, non_blocking=True), d,
                    gamma=self.gamma, chunk=self.dcfg.loss_chunk, rows=picked,
                    loss_weights=(dsp.ce_weight, dsp.tv_weight, dsp.conf_weight))
                terms += lo.terms
            else:
                lo = obj.chunked_loss(hidden, labels, d.lm_head.weight, self.gamma,
                                      self.dcfg.loss_chunk, rows=picked)
            if len(picked.rows):  # the weights of labelled slots are > 0 under either loss
                (lo.loss * lo.weight_sum).backward()
            loss_sum += lo.loss.detach() * lo.weight_sum
            tau_sum += lo.tau_sum
            out.weight_sum += lo.weight_sum
            out.blocks += lo.blocks
            del feats, hidden, lo
        out.loss_sum, out.tau_sum = loss_sum, tau_sum
        if dsp is not None:
            out.terms = terms
        self.micro.add(out)
        return out

    def discard_step(self) -> None:
        """Forget what this replica accumulated since the last optimizer step (its gradients and
        counts), so the step's batches can be trained again from scratch."""
        self.flat.zero_()
        self.micro = Micro()
        self.sample_ids = []

    def back_off(self) -> tuple[int, int] | None:
        """After an out-of-memory error: halve the micro-group (the sequences of the last batch
        whose blocks live at once) by lowering micro_block_tokens. Returns (old, new), or None
        when a group is already one sequence (no smaller size exists)."""
        per_seq = self.last_block_tokens
        group = min(self.micro_block_tokens // per_seq, self.last_rows) if per_seq else 0
        smaller = halve(group, 1)  # the levers' one rule, counted in sequences
        if smaller is None:
            return None
        old = self.micro_block_tokens
        self.micro_block_tokens = smaller * per_seq
        return old, self.micro_block_tokens

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
    # DSpark: its three terms' weighted means ("loss_ce", "loss_tv", "loss_conf")
    extra = {f"loss_{k}": stats[k] / max(stats["weight"], 1e-12)
             for k in lead.stats[len(STATS):]}
    return StepResult(
        step=step + 1, loss=loss, lr=lr, grad_norm=grad_norm,
        tau_tf=stats["tau"] / max(stats["blocks"], 1), tokens=tokens,
        samples=int(stats["samples"]), padding_frac=padded and (padded - tokens) / padded,
        extra=extra,
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


def build_replicas(dcfg: DrafterConfig, optim: OptimConfig, target,
                   devices: list[torch.device], *, seed: int, layer_ids: list[int], mask_id: int,
                   resume=None, dspark: DSparkSettings | None = None) -> list[DrafterReplica]:
    """The drafter (from a checkpoint to resume, ``drafter.init_from``, or fresh from the target's
    shape) and one replica of it per drafter device, each with the target's frozen embedding and
    head. ``dcfg``, ``optim``: the config's drafter and optim sections; ``seed``: run.seed (a
    fresh drafter's init). ``target``: a loaded TargetModel; ``resume``: a checkpoint's
    ResumeState or None; ``dspark``: DSpark's settings when the objective is DSpark (None:
    DFlash). A checkpoint or folder of the other objective raises
    drafter_kinds.ObjectiveMismatch."""
    objective = "dspark" if dspark is not None else "dflash"
    if resume is not None:
        drafter = drafter_from_config(resume.drafter_config, objective)
        # A checkpoint without master weights reads model.safetensors, which for DSpark also
        # holds the frozen copies of the target's embedding and lm_head (borrowed, not state).
        drafter.load_state_dict({k: v for k, v in resume.drafter_state.items()
                                 if k not in dspark_format.FROZEN_KEYS})
    elif dcfg.init_from:
        drafter = load_drafter(dcfg.init_from, objective)
    else:
        d = dcfg
        torch.manual_seed(seed)
        drafter = new_drafter(
            objective, target.model.config, num_layers=d.num_layers, target_layer_ids=layer_ids,
            block_size=d.block_size, mask_token_id=mask_id, dspark_settings=dspark,
            hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
            num_attention_heads=d.num_attention_heads, num_key_value_heads=d.num_key_value_heads)
    embed = nn.Embedding.from_pretrained(target.embed_tokens.weight.detach().clone(), freeze=True)
    head = nn.Linear(target.hidden_size, target.vocab_size, bias=False)
    head.weight = nn.Parameter(target.lm_head.weight.detach().clone(), requires_grad=False)
    if devices[0].type == "cpu":
        embed, head = embed.float(), head.float()
    reps = make_replicas(drafter, devices, dcfg, optim, embed, head, dspark)
    if resume is not None:
        for r in reps:
            r.optimizer.load_state_dict(resume.optimizer_state)
    return reps


def make_replicas(drafter: DFlashDrafter, devices: list[torch.device], dcfg: DrafterConfig,
                  optim: OptimConfig, embed: nn.Embedding, lm_head: nn.Linear,
                  dspark: DSparkSettings | None = None) -> list[DrafterReplica]:
    reps = []
    for i, dev in enumerate(devices):
        d = drafter if i == 0 else copy.deepcopy(drafter)
        # Each replica gets its own copy of the frozen head on its own device.
        e, h = (embed, lm_head) if i == 0 else (copy.deepcopy(embed), copy.deepcopy(lm_head))
        reps.append(DrafterReplica(d, dev, dcfg, optim, e, h, dspark))
    return reps


def _dspark_settings(drafter, dspark: DSparkSettings | None, dcfg: DrafterConfig):
    """The DSpark settings a replica trains with, None for a DFlash drafter."""
    if not isinstance(drafter, DSparkDrafter):
        if dspark is not None:
            raise ValueError("DSpark settings given for a DFlash drafter")
        return None
    if dcfg.loss == "dpace":
        raise ValueError("drafter.loss dpace does not apply to drafter.objective dspark: its "
                         "slot weights are exp(-j/gamma) on each block's surviving prefix; set "
                         "drafter.loss: dflash")
    return (dspark or DSparkSettings(block_size=drafter.block_size,
                                     markov_rank=drafter.markov_rank)).check()


def _check_dspark_features(drafter, features: torch.Tensor) -> None:
    """DSpark's features end with the target's post-norm last hidden state: (k+1)*H wide."""
    H, k = drafter.config.hidden_size, len(drafter.target_layer_ids)
    if features.shape[-1] != (k + 1) * H:
        raise ValueError(f"DSpark needs the target's post-norm last hidden state after its {k} "
                         f"layer features ({(k + 1) * H} values per token), got "
                         f"{features.shape[-1]}: the target stage must append it")


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
